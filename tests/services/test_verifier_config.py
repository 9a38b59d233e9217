"""The run's `[verifier]` section: composed into RunConfig, set from the command line, checked by
field, never holding the token; rows routed to the verifier it names; VerifierOutage reaches the
pool's caller and stops the rest of the batch."""

from __future__ import annotations

import asyncio
import re

import pytest

from threepo.deploy.config import ConfigError, load_config, to_toml
from threepo.services.errors import UserInputError
from threepo.services.verifiers.base import VerifierOutage
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool, auth_token
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyResult, VerifyStatus

ROUTE = 'verifier.route=[["code_output", "remote_sandbox"]]'


def test_verifier_section_from_the_command_line_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDBOX_TOKEN", "s3cret")
    cfg = load_config(None, [ROUTE, 'verifier.endpoints=["http://a:1", "https://b:2"]',
                             "verifier.auth_env=SANDBOX_TOKEN", "verifier.outage_s=60", "verifier.cluster_concurrency=16",
                             "verifier.memory_limit_mb=512"])
    v = cfg.verifier
    assert v.route == (("code_output", "remote_sandbox"),) and v.endpoints == ("http://a:1", "https://b:2")
    assert v.outage_s == 60.0 and v.cluster_concurrency == 16
    text = to_toml(cfg)
    assert "[verifier]" in text and "s3cret" not in text
    (tmp_path / "run.toml").write_text(text)
    assert load_config(str(tmp_path / "run.toml")).verifier == v
    remote = v.remote_config()  # read from the environment only now
    assert remote.auth_token == "s3cret" and remote.endpoints == v.endpoints and remote.outage_s == 60.0
    assert remote.memory_limit_mb == 512  # every remote field of the run's section reaches the client


@pytest.mark.parametrize("override,message", [
    ('verifier.endpoints=["sandbox:8080"]', "verifier.endpoints: expected http(s) URLs"),
    ("verifier.outage_s=0", "verifier.outage_s: expected > 0"),
    ("verifier.cooldown_s=-1", "verifier.cooldown_s: expected > 0"),
    ("verifier.max_attempts=0", "verifier.max_attempts: expected >= 1"),
    ("verifier.unhealthy_after=0", "verifier.unhealthy_after: expected >= 1"),
    ("verifier.cluster_concurrency=-1", "verifier.cluster_concurrency: expected >= 0"),
    ("verifier.memory_limit_mb=0", "verifier.memory_limit_mb: expected -1 (the service's default) or >= 1"),
    ("verifier.jitter=2", "jitter"),
    ('verifier.auth_env="Bearer abc"', "verifier.auth_env: expected the NAME of an environment variable"),
    ('verifier.route=[["code_output"]]', "verifier.route: expected [row verifier, verifier] pairs"),
    ("verifier.endpoints=8080", "verifier.endpoints: expected a list"),
])
def test_bad_verifier_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_the_token_variable_must_be_set(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    with pytest.raises(UserInputError, match="verifier.auth_env='NO_SUCH_TOKEN_VAR': the environment variable is not set"):
        auth_token("NO_SUCH_TOKEN_VAR")
    assert auth_token("") == ""


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
    cfg = VerifierConfig(route=(("code_output", "remote_sandbox"),), endpoints=("http://sandbox:9",))
    pool = VerifierPool(cfg.pool_config(token=""), factories={"remote_sandbox": remote, "code_output": None})
    results = pool.verify_batch(rows(3))
    assert [r.status for r in results] == [VerifyStatus.OK] * 3 and built["remote"].seen == ["r0", "r1", "r2"]
    assert built["remote"].options["config"].endpoints == ("http://sandbox:9",)  # configured from [verifier]


def test_verifier_outage_reaches_the_caller_and_stops_the_batch():
    verifier = Recorder("remote_sandbox", outage_on="r1")
    pool = VerifierPool(VerifierConfig(max_concurrency=4).pool_config(token=""),
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
    pool = VerifierPool(VerifierConfig(max_concurrency=4, backoff_base_s=0.0, backoff_max_s=0.0).pool_config(""),
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
