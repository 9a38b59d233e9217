"""A code-task run scored by the sandbox server on loopback, configured from the command line
(`threepo train task.family=code sandbox.endpoints=[...] verifier.route=[...]`), behind a proxy
that answers 30% of requests with 503: it completes with exact counts and no infra_error. The policy is a tiny model warm-started on the code task just long enough to write
`\\boxed{print(...)}` programs, so the completions reach the sandbox."""

from __future__ import annotations

import json
import shutil

import pytest

from threepo.services.verifiers.fault_proxy import FaultConfig, FaultProxy, serve_in_thread
from threepo.services.verifiers.sandbox import SandboxConfig
from threepo.services.verifiers.sandbox_server import SERVICE, SandboxServerConfig, make_app

pytestmark = [pytest.mark.ray, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing")]

TOKEN_ENV = "THREEPO_TEST_SANDBOX_TOKEN"


@pytest.fixture(scope="module")
def code_policy(tmp_path_factory) -> str:
    from threepo.services.bootstrap import BootstrapConfig, bootstrap
    from threepo.services.model.modeling import ModelConfig
    from threepo.services.tasks.synthetic import TaskConfig

    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    cfg = BootstrapConfig(max_steps=80, eval_every=1000, eval_items=8, batch_size=32, warmup_steps=10,
                          target_pass1=0.9, threads=1)
    out = str(tmp_path_factory.mktemp("code-policy") / "model")
    return bootstrap(model, TaskConfig(family="code", difficulty=1), cfg, out_dir=out, progress=False).path


@pytest.fixture
def sandbox():
    app = make_app(SandboxServerConfig(port=0, workers=2, auth_token="s3cret",
                                       sandbox=SandboxConfig(wall_timeout_s=2.0)))
    server = serve_in_thread(app)
    yield server, app[SERVICE]
    server.stop()


def train_code(tmp_path, policy, endpoint, monkeypatch, *extra) -> tuple[int, dict, list]:
    from threepo.deploy.cli import main

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    runs = tmp_path / "runs"
    rc = main(["train", f"model.path={policy}", f"runs_dir={runs}", "task.family=code", "task.difficulty=1",
               f'sandbox.endpoints=["{endpoint}"]', 'verifier.route=[["code_output", "remote_sandbox"]]',
               f"sandbox.auth_env={TOKEN_ENV}", f"verifier.limiter_name=test-limiter-{tmp_path.name}",
               "verifier.cluster_concurrency=4", "sandbox.backoff_base_s=0.05", "sandbox.cooldown_s=0.5",
               "runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.5", "runtime.verifier_cpus=0.25",
               "runtime.prompts_per_step=2", "runtime.steps=2", "runtime.checkpoint_every=end",
               "algo.group_size=8", "sampler.max_new_tokens=24", "eval.num_items=4",
               "eval.samples_per_item=2", "eval.k=1", *extra])
    (run_dir,) = list(runs.iterdir())
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    with open(run_dir / "config.toml") as f:
        assert "s3cret" not in f.read()  # the token is read from the environment, never written
    return rc, summary, [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _kill_limiter(tmp_path):
    """The limiter actor is detached (it outlives runs by design): remove this test's."""
    import ray

    name = f"test-limiter-{tmp_path.name}"
    if {"name": name, "namespace": "threepo"} in ray.util.list_named_actors(all_namespaces=True):
        ray.kill(ray.get_actor(name, namespace="threepo"))


def test_a_code_run_configured_from_the_cli_completes_behind_a_sandbox_answering_503_to_30_percent(
        ray_session, tmp_path, code_policy, sandbox, monkeypatch):
    server, service = sandbox
    proxy = FaultProxy(FaultConfig(server.url, error_rate=0.3, seed=1))
    front = serve_in_thread(proxy.app())
    try:
        rc, summary, rows = train_code(tmp_path, code_policy, front.url, monkeypatch)
    finally:
        front.stop()
        _kill_limiter(tmp_path)
    assert rc == 0 and [r["step"] for r in rows] == [1, 2]
    assert summary["consumed_rollouts"] == summary["admitted_rollouts"] == 32
    assert summary["infra_errors"] == 0 and summary["reissued_requests"] == 0  # waited out, never re-sampled
    # the completions were programs the sandbox ran (training and the evaluations), through the proxy
    assert service.stats["started"] >= 16 and proxy.counts["forwarded"] == service.stats["started"]
    assert proxy.counts["error"] >= 3


def test_a_sandbox_down_for_good_stops_the_run_with_a_summary_and_it_resumes_later(
        ray_session, tmp_path, code_policy, sandbox, monkeypatch):
    import socket

    from threepo.deploy.cli import main

    with socket.socket() as s:  # a port nothing listens on: every request is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    try:
        rc, summary, rows = train_code(tmp_path, code_policy, dead, monkeypatch, "sandbox.outage_s=2",
                                       "runtime.steps=3", "eval.around_training=false")
    finally:
        _kill_limiter(tmp_path)
    assert rc == 1 and "no sandbox endpoint answered" in summary["stopped"]
    assert summary["infra_errors"] == 0 and summary["steps"] == 0  # nothing unscored reached the learner
    (run_dir,) = list((tmp_path / "runs").iterdir())
    server, _ = sandbox
    assert main(["train", "--resume", str(run_dir), f'sandbox.endpoints=["{server.url}"]',
                 "sandbox.outage_s=60"]) == 0
    with open(run_dir / "summary.json") as f:
        resumed = json.load(f)
    assert resumed["steps"] == 3 and resumed["consumed_rollouts"] == resumed["admitted_rollouts"] == 3 * 16
    _kill_limiter(tmp_path)
