"""Ray integration tests of the real driver on CPU: a few steps of every algorithm; faults — a sampler
killed mid-run, a sampler killed while idle, the learner killed mid-run (restored by the driver), a
verifier that dies on every batch (bounded), the driver itself killed at a random point and resumed;
and stop/resume giving the same steps as an uninterrupted run. Records are checked for exactness
every time: admitted = consumed, each completion id once in rollouts.log, each step once in
metrics.jsonl. One Ray cluster for the whole session (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from threepo.algorithms.noise_mask import noised_names
from threepo.deploy.commands import make_run_dir
from threepo.deploy.config import load_config
from threepo.deploy.run import RunStopped, train
from threepo.services.model.modeling import load_model

pytestmark = pytest.mark.ray

SMALL = ["runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.5", "runtime.verifier_cpus=0.25",
         "runtime.prompts_per_step=2", "runtime.steps=3", "runtime.checkpoint_every=end", "runtime.eval_every=off",
         "algo.group_size=8", "sampler.max_new_tokens=12"]


def _cfg(tmp_path, model_path, *overrides):
    return load_config(None, [f"model.path={model_path}", f"runs_dir={tmp_path}", *SMALL, *overrides])


def _metrics(run_dir):
    """The rows of metrics.jsonl; a line the driver is still writing (no newline yet) is not a row."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _exact(run_dir, summary, steps, rollouts_per_step):
    """The records of a finished run are exact: every step once, every consumed completion once."""
    from threepo.services.wire.batching import logged_groups

    rows = [r for r in _metrics(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    ids = [s.completion.completion_id for g in logged_groups(os.path.join(run_dir, "rollouts.log"))
           for s in g.completions]
    assert len(ids) == len(set(ids)) == summary["consumed_rollouts"] == summary["admitted_rollouts"]
    assert summary["consumed_rollouts"] == steps * rollouts_per_step and summary["steps"] == steps
    return rows


ALGORITHMS = {
    "grpo_adamw": ["algo.exploration=none", "algo.n_slots=1", "optim.name=adamw", "optim.lr=1e-4"],
    "dr_grpo": ["algo.exploration=none", "algo.n_slots=1", "algo.advantage=dr_grpo",
                "algo.loss_agg=seq-mean-token-sum-norm"],
    "grpo_lora": ["algo.exploration=none", "algo.n_slots=1", "optim.name=adamw", "optim.lr=1e-3", "lora.rank=4"],
    "c3po_lora": ["algo.exploration=c3po", "algo.n_slots=4", "lora.rank=4"],
    "b3po": ["algo.exploration=b3po", "algo.n_slots=1"],
    "m3po": ["algo.exploration=m3po", "algo.n_slots=2"],
    "c3po_lampo": ["algo.exploration=c3po", "algo.n_slots=4", "algo.advantage=lampo", "algo.kl_coef=1e-3"],
    "entropy_bonus_temperature": ["algo.exploration=none", "algo.n_slots=1", "optim.name=adamw",
                                  "algo.entropy_coef=5e-3", "sampler.temperature=1.3", "algo.eps_high=0.28",
                                  "algo.mini_batches=2"],
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_few_steps_of_each_algorithm(ray_session, tmp_path, tiny_dense_path, name):
    cfg = _cfg(tmp_path, tiny_dense_path, *ALGORITHMS[name])
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_dense_path)
    # every plan here spends G = 8 rollouts per prompt (equal-compute M3PO: 2 groups of 4)
    rows = _exact(run_dir, summary, 3, 2 * 8)
    assert all(r["completion_tokens"] > 0 and r["loss"] == r["loss"] for r in rows)  # finite
    assert all(0 <= r.get("engine_busy_mean", 0) <= 1 and r["time_window_s"] > 0 for r in rows)
    assert os.path.isfile(os.path.join(summary["final_checkpoint"], "model.safetensors"))
    if name in ("b3po", "m3po", "c3po_lampo", "c3po_lora"):
        assert rows[-1]["sigma_p50"] > 0  # a posterior with noise served the rollouts
    if name.endswith("_lora"):  # the merged model above, and the adapters as a PEFT adapter directory
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(
            os.listdir(os.path.join(summary["final_checkpoint"], "adapter")))
    params = dict(load_model(tiny_dense_path).named_parameters())
    full_mb = 8 * sum(p.numel() for p in params.values()) / 2**20  # fp32 m and σ of every tensor
    if name.endswith("_lora"):  # a version is the adapters alone (C3PO: their m and σ), which hf engines serve
        assert 0 < summary["version_mb"] < full_mb / 4
    elif name in ("b3po", "m3po", "c3po_lampo"):  # m whole, σ of the noise mask's tensors alone
        masked_mb = 4 * sum(params[n].numel() for n in noised_names(list(params))) / 2**20
        assert summary["version_mb"] == pytest.approx(full_mb / 2 + masked_mb, rel=0.01) and masked_mb < full_mb / 2


def _kill_when(run_dir, name, rows_seen, also_restart=True, after=None):
    """A thread killing actor `name` once metrics.jsonl has `rows_seen` rows (and `after(row)` holds)."""
    import ray

    killed = []

    def kill():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            path = os.path.join(run_dir, "metrics.jsonl")
            rows = _metrics(run_dir) if os.path.exists(path) else []
            if len(rows) >= rows_seen and (after is None or after(rows[-1])):
                ray.kill(ray.get_actor(name), no_restart=not also_restart)
                killed.append(name)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread, killed


def test_killing_a_sampler_mid_run_loses_and_duplicates_nothing(ray_session, tmp_path, tiny_dense_path):
    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.steps=8", "runtime.max_offpolicy=2")
    run_dir = make_run_dir(cfg, "train")
    thread, killed = _kill_when(run_dir, f"{os.path.basename(run_dir)}-sampler-0", 1)
    summary = train(cfg, run_dir, tiny_dense_path)
    thread.join()
    assert killed, "the sampler was never killed"
    assert summary["sampler_failures"] >= 1 and summary["reissued_requests"] >= 1
    _exact(run_dir, summary, 8, 2 * 8)


def test_a_sampler_that_dies_while_idle_serves_again_after_its_restart(ray_session, tmp_path, tiny_dense_path):
    # sync mode: when a step's row is written the samplers have nothing to do until the next step
    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.mode=sync", "runtime.steps=5", "sync.max_staleness=1",
               "runtime.num_samplers=2")
    run_dir = make_run_dir(cfg, "train")
    thread, killed = _kill_when(run_dir, f"{os.path.basename(run_dir)}-sampler-1", 2)
    summary = train(cfg, run_dir, tiny_dense_path)
    thread.join()
    assert killed
    rows = _exact(run_dir, summary, 5, 2 * 8)
    assert summary["rejected_weights"] == 0 and rows[-1]["version"] >= 3  # the restarted sampler took new versions


def _killed_and_restored(cfg, model_path: str, actor: str) -> None:
    """A 6-step run (checkpoint every 2) whose actor `<run>-<actor>` is killed at step 3 for good:
    the run completes, the steps after the checkpoint redone and recorded exactly once."""
    run_dir = make_run_dir(cfg, "train")
    thread, killed = _kill_when(run_dir, f"{os.path.basename(run_dir)}-{actor}", 3, also_restart=False)
    summary = train(cfg, run_dir, model_path)
    thread.join()
    assert killed
    _exact(run_dir, summary, 6, 2 * 8)  # the steps after the checkpoint were redone, not recorded twice


def test_a_dead_learner_is_restored_from_the_latest_checkpoint(ray_session, tmp_path, tiny_dense_path):
    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.steps=6", "runtime.checkpoint_every=2")
    _killed_and_restored(cfg, tiny_dense_path, "learner")


class DyingVerifier:
    """A verifier actor whose process dies on every batch (Ray restarts it each time)."""

    def __init__(self, *args) -> None:
        pass

    def score(self, batch):
        os._exit(1)


def test_a_verifier_that_keeps_dying_stops_the_run_with_the_reason(ray_session, tmp_path, tiny_dense_path):
    import ray

    from threepo.deploy.actors import start_roles, stop_roles
    from threepo.deploy.cluster import init_ray
    from threepo.deploy.run import run

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.max_reissues=2")
    run_dir = make_run_dir(cfg, "train")
    init_ray(cfg)
    roles = start_roles(cfg, tiny_dense_path, run_dir)
    for v in roles.verifiers:
        ray.kill(v, no_restart=True)
    roles.verifiers = [ray.remote(DyingVerifier).options(max_restarts=-1, num_cpus=0).remote()]
    try:
        with pytest.raises(RunStopped, match="verifiers died 2 times on one batch"):
            run(cfg, run_dir, roles)
    finally:
        stop_roles(roles)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert "verifiers died" in summary["stopped"] and summary["verifier_failures"] >= 2


def test_stop_and_resume_continues_the_same_run(ray_session, tmp_path, tiny_dense_path):
    det = ["runtime.mode=sync", "runtime.steps=4", "runtime.checkpoint_every=2", "runtime.keep_checkpoints=3"]
    cfg = _cfg(tmp_path / "a", tiny_dense_path, *det)
    full_dir = make_run_dir(cfg, "train")
    train(cfg, full_dir, tiny_dense_path)
    full = _metrics(full_dir)

    from threepo.deploy import checkpoints

    cfg_b = _cfg(tmp_path / "b", tiny_dense_path, *det, 'runtime.trackers=["tensorboard", "wandb"]')
    part_dir = make_run_dir(cfg_b, "train")
    train(load_config(os.path.join(part_dir, "config.toml"), ["runtime.steps=2"]), part_dir, tiny_dense_path)
    ckpt = checkpoints.latest(part_dir)
    assert checkpoints.load_driver(ckpt)["ledger"]["step"] == 2
    summary = train(cfg_b, part_dir, tiny_dense_path, resume_from=ckpt)
    resumed = _exact(part_dir, summary, 4, 2 * 8)
    for a, b in zip(full[2:], resumed[2:]):  # the steps after the resume match the uninterrupted run
        assert a["version"] == b["version"]
        for key in ("reward_mean", "loss", "kl_k3", "completion_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(part_dir, "tensorboard"))  # both sittings' events, one directory
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (row["step"], pytest.approx(row["reward_mean"])) for row in resumed]
    offline = {name.rsplit("-", 1)[1] for name in os.listdir(os.path.join(part_dir, "wandb")) if name.startswith("offline-run-")}
    assert len(offline) == 1  # the resumed sitting continues the same W&B run


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (the driver started its local Ray's processes in it)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_killing_the_driver_at_a_random_point_and_resuming_keeps_records_exact(tmp_path, tiny_dense_path):
    # the real CLI in a subprocess with its own local Ray; SIGKILL after a random number of steps
    from threepo.deploy import checkpoints

    args = [sys.executable, "-m", "threepo.deploy.cli", "train", f"model.path={tiny_dense_path}",
            f"runs_dir={tmp_path}", *SMALL, "runtime.steps=8", "runtime.checkpoint_every=2", "eval.num_items=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    kill_after = random.Random(os.getpid()).randint(3, 6)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = [d for d in tmp_path.iterdir() if d.name.startswith("threepo-train-")]
        # a random step past the first committed checkpoint (saves commit asynchronously, after the step's row)
        if (runs and os.path.exists(runs[0] / "metrics.jsonl") and len(_metrics(runs[0])) >= kill_after
                and checkpoints.latest_or_none(str(runs[0])) is not None):
            break
        time.sleep(0.05)
    _kill_session(victim.pid)  # the driver and its local Ray, mid-run
    victim.wait()
    (run_dir,) = runs
    done = subprocess.run([*args, "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    _exact(str(run_dir), summary, 8, 2 * 8)


def test_vp2o_on_the_tiny_moe(ray_session, tmp_path, tiny_moe_path):
    cfg = _cfg(tmp_path, tiny_moe_path, "model.kind=moe", "algo.vp2o=true", "algo.exploration=c3po")
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_moe_path)
    rows = _exact(run_dir, summary, 3, 2 * 8)
    assert all(0.0 <= r["vp2o_clamped_frac"] <= 1.0 and r["vp2o_bandwidth_mean"] > 0 for r in rows)
    assert all(r["vp2o_l_orth"] >= 0 for r in rows)
    assert any(r["vp2o_attract_pairs"] > 0 for r in rows)  # the default lifts attract for top-2 of 4


def test_dead_group_aware_exploration_and_dynamic_filter_keep_records_exact(ray_session, tmp_path, tiny_dense_path):
    # the random tiny model fails almost every rollout: dead prompts come back with σ × 2, and the
    # filter drops one equal-reward prompt per step and admits another in its place; without the
    # noise control every version's slots have c = 1, so a re-admitted slot's c is 2 exactly (with it,
    # 2 × the version's c: ExplorationPlan.scaled multiplies, tests/algorithms/test_exploration.py)
    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.steps=4", "algo.readmit_fraction=0.5", "algo.dead_group_scale=2.0",
               "algo.dynamic_filter=true", "algo.filter_replacements=0.5", "noise.target_kl=off")
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_dense_path)
    from threepo.services.wire.batching import logged_groups

    groups = list(logged_groups(os.path.join(run_dir, "rollouts.log")))
    ids = [s.completion.completion_id for g in groups for s in g.completions]
    assert len(ids) == len(set(ids)) == summary["consumed_rollouts"] == 4 * 2 * 8
    assert summary["admitted_rollouts"] == summary["consumed_rollouts"] + summary["dropped_rollouts"]
    assert summary["readmitted_prompts"] >= 1 and summary["dropped_groups"] >= 1
    scaled = {s.completion.slot_scale for g in groups if "/r1" in g.group_id for s in g.completions}
    assert scaled == {2.0} and {s.completion.slot_scale for g in groups if "/r" not in g.group_id
                                for s in g.completions} == {1.0}
    rows = [r for r in _metrics(run_dir) if "reward_mean" in r]
    assert rows[-1]["readmitted_prompts"] == summary["readmitted_prompts"]
    assert [r["kl_k3_drift"] for r in rows if "kl_k3_drift" in r][-1] < 1e-3  # the last step measuring it
