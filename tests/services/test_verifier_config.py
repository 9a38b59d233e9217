"""The run's `[verifier]` and `[sandbox]` sections: composed into RunConfig, set from the command line,
checked by field, never holding the token, a moved setting named with its new key; rows routed to the
verifier it names, the remote one built from `[sandbox]`; VerifierOutage reaches the pool's caller
and stops the rest of the batch."""

from __future__ import annotations

import asyncio
import re

import pytest

from threepo.deploy.config import ConfigError, load_config, to_toml
from threepo.services.errors import UserInputError
from threepo.services.verifiers.base import VerifierOutage
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyResult, VerifyStatus

ROUTE = 'verifier.route=[["code_output", "remote_sandbox"]]'


def test_verifier_and_sandbox_sections_from_the_command_line_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDBOX_TOKEN", "s3cret")
    cfg = load_config(None, [ROUTE, 'sandbox.endpoints=["http://a:1", "https://b:2"]',
                             "sandbox.auth_env=SANDBOX_TOKEN", "sandbox.outage_s=60", "verifier.cluster_concurrency=16",
                             "sandbox.memory_limit_mb=512"])
    v, sandbox = cfg.verifier, cfg.sandbox
    assert v.route == (("code_output", "remote_sandbox"),) and sandbox.endpoints == ("http://a:1", "https://b:2")
    assert sandbox.outage_s == 60.0 and sandbox.memory_limit_mb == 512 and v.cluster_concurrency == 16
    text = to_toml(cfg)
    assert "[verifier]" in text and "[sandbox]" in text and "s3cret" not in text
    (tmp_path / "run.toml").write_text(text)
    again = load_config(str(tmp_path / "run.toml"))
    assert (again.verifier, again.sandbox) == (v, sandbox)
    assert sandbox.token() == "s3cret"  # read from the environment only when asked


def test_a_moved_setting_names_its_new_key():
    with pytest.raises(ConfigError, match=re.escape("verifier.endpoints: moved to sandbox.endpoints")):
        load_config(None, ['verifier.endpoints=["http://a:1"]'])
    with pytest.raises(ConfigError, match=re.escape("the remote sandbox is configured in [sandbox] (sandbox.outage_s")):
        load_config(None, ['verifier.options=[["remote_sandbox", "outage_s", "1"]]'])


@pytest.mark.parametrize("override,message", [
    ('sandbox.endpoints=["sandbox:8080"]', "sandbox.endpoints: expected http(s) URLs"),
    ("sandbox.outage_s=0", "sandbox.outage_s: expected > 0"),
    ("sandbox.cooldown_s=-1", "sandbox.cooldown_s: expected > 0"),
    ("sandbox.max_attempts=0", "sandbox.max_attempts: expected >= 1"),
    ("sandbox.unhealthy_after=0", "sandbox.unhealthy_after: expected >= 1"),
    ("verifier.cluster_concurrency=0", "verifier.cluster_concurrency: expected >= 1, or \"off\""),
    ("sampler.max_model_len=0", "sampler.max_model_len: expected a positive integer or \"auto\""),
    ("sandbox.memory_limit_mb=0", "sandbox.memory_limit_mb: expected -1 (the service's default) or >= 1"),
    ("verifier.jitter=2", "verifier.jitter"),
    ("sandbox.jitter=2", "sandbox.backoff_base_s/backoff_max_s/jitter"),
    ('sandbox.auth_env="Bearer abc"', "sandbox.auth_env: expected the NAME of an environment variable"),
    ('verifier.route=[["code_output"]]', "verifier.route: expected [row verifier, verifier] pairs"),
    ("sandbox.endpoints=8080", "sandbox.endpoints: expected a list"),
])
def test_bad_verifier_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_the_token_variable_must_be_set(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    with pytest.raises(UserInputError, match="sandbox.auth_env='NO_SUCH_TOKEN_VAR': the environment variable is not set"):
        RemoteSandboxConfig(auth_env="NO_SUCH_TOKEN_VAR").token()
    assert RemoteSandboxConfig().token() == ""


class Recorder:
    def __init__(self, name, outage_on=None, **options):
        self.name, self.outage_on, self.options, self.seen = name, outage_on, options, []

    async def verify(self, request):
        self.seen.append(request.item.uid)
        if request.item.uid == self.outage_on:
            await asyncio.sleep(0.05)
            raise VerifierOutage("every endpoint down")
        await asyncio.sleep(0.01 if self.outage_on is None else 10)
        return VerifyResult(VerifyStatus.OK, 1.0, "", 0.0)

    def close(self):
        pass


def rows(n, verifier="code_output"):
    return [VerifyRequest(TaskItem(uid=f"r{i}", prompt="", answer="1", verifier=verifier), "x") for i in range(n)]


def test_rows_go_to_the_verifier_the_route_names():
    built = {}

    def remote(**options):
        built["remote"] = Recorder("remote_sandbox", **options)
        return built["remote"]
    cfg = VerifierConfig(route=(("code_output", "remote_sandbox"),))
    pool = VerifierPool(cfg, sandbox=RemoteSandboxConfig(endpoints=("http://sandbox:9",)), token="t0k",
                        factories={"remote_sandbox": remote, "code_output": None})
    results = pool.verify_batch(rows(3))
    assert [r.status for r in results] == [VerifyStatus.OK] * 3 and built["remote"].seen == ["r0", "r1", "r2"]
    assert built["remote"].options["config"].endpoints == ("http://sandbox:9",)  # configured from [sandbox]
    assert built["remote"].options["token"] == "t0k"


def test_verifier_outage_reaches_the_caller_and_stops_the_batch():
    verifier = Recorder("remote_sandbox", outage_on="r1")
    pool = VerifierPool(VerifierConfig(max_concurrency=4),
                        factories={"code_output": lambda **o: verifier})
    with pytest.raises(VerifierOutage, match="every endpoint down"):
        pool.verify_batch(rows(4))
    assert not [t for t in asyncio.all_tasks(pool._loop) if not t.done()]  # nothing left running
    pool.close()


def test_evaluation_verifies_through_the_pool_concurrently_and_closes_its_verifiers():
    from threepo.services.evaluation import evaluate
    from threepo.services.wire.messages import GeneratedSample

    class Flaky(Recorder):
        in_flight = peak = closed = 0

        async def verify(self, request):
            Flaky.in_flight += 1
            Flaky.peak = max(Flaky.peak, Flaky.in_flight)
            await asyncio.sleep(0.01)
            Flaky.in_flight -= 1
            self.seen.append(request.item.uid)
            first = self.seen.count(request.item.uid) == 1 and request.item.uid == "r0"
            return VerifyResult(VerifyStatus.INFRA_ERROR if first else VerifyStatus.OK, 1.0, "", 0.0)

        def close(self):
            Flaky.closed += 1

    class Prompts:
        stop_ids = (1,)

        def encode(self, prompt, verifier):
            return (5,)

    items = [r.item for r in rows(12)]
    generate = lambda requests, params: [[GeneratedSample((7,), (0.0,), "stop", f"{i}")]  # noqa: E731
                                         for i, _ in enumerate(requests)]
    pool = VerifierPool(VerifierConfig(max_concurrency=4, backoff_base_s=0.0, backoff_max_s=0.0),
                        factories={"code_output": lambda **o: Flaky("code_output")})
    report = evaluate(generate, items, pool.verify_batch, Prompts(), samples_per_item=1, k=1, temperature=0.0,
                      max_new_tokens=4)
    pool.close()
    assert report.pass_at_1 == 1.0  # the infra_error of r0 was retried, as in training
    assert Flaky.peak == 4 and Flaky.closed == 1


def test_evaluation_keeps_each_items_count_so_pass_at_any_k_is_the_unbiased_estimate():
    from threepo.algorithms.pass_at_k import pass_at_k
    from threepo.services.evaluation import evaluate
    from threepo.services.wire.messages import GeneratedSample

    class Prompts:
        stop_ids = (1,)

        def encode(self, prompt, verifier):
            return (5,)

    passing = {"r0": 3, "r1": 0, "r2": 1}  # item -> how many of its 4 samples pass

    def verify(requests):
        seen: dict[str, int] = {}
        out = []
        for r in requests:
            seen[r.item.uid] = seen.get(r.item.uid, 0) + 1
            ok = seen[r.item.uid] <= passing[r.item.uid]
            out.append(VerifyResult(VerifyStatus.OK if ok else VerifyStatus.WRONG, float(ok), "", 0.0))
        return out

    items = [r.item for r in rows(3)]
    generate = lambda requests, params: [[GeneratedSample((7,), (0.0,), "stop", "x")] * r.n  # noqa: E731
                                         for r in requests]
    report = evaluate(generate, items, verify, Prompts(), samples_per_item=4, k=2, temperature=1.0, max_new_tokens=4)
    assert report.correct == (3, 0, 1)
    assert report.pass_at(2) == pytest.approx(report.pass_at_k)
    assert report.pass_at(4) == pytest.approx(2 / 3)
    assert report.pass_at(3) == pytest.approx(float(pass_at_k([4] * 3, [3, 0, 1], 3).mean()))
    with pytest.raises(ValueError, match="samples_per_item=4"):
        report.pass_at(5)
    assert report.summary().startswith(f"pass@1 {report.pass_at_1:.3f}  pass@2 {report.pass_at_k:.3f}  malformed")
    greedy = evaluate(generate, items, verify, Prompts(), samples_per_item=1, k=1, temperature=0.0, max_new_tokens=4)
    assert greedy.summary().startswith(f"pass@1 {greedy.pass_at_1:.3f}  malformed")  # pass@1 once when k = 1
