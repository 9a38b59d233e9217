"""VerifierPool: infra_error retries with backoff (no real sleeps), NaN when retries run out, order
and the concurrency limit, lazy per-name verifiers with options, the real math verifier through it."""

from __future__ import annotations

import asyncio
import math

import pytest

from threepo.services.metrics import PrometheusMetrics
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyResult, VerifyStatus

NAN = float("nan")


def request(uid, verifier="fake", completion="", answer="1"):
    return VerifyRequest(TaskItem(uid=uid, prompt="Q: ", answer=answer, verifier=verifier), completion)


class FakeVerifier:
    """Fails `failures[uid]` times with infra_error (reward `infra_reward`), then scores uid-dependent.

    Each verify yields `yields[uid]` times to the loop, so later requests can finish first."""

    name = "fake"

    def __init__(self, failures=None, yields=None, infra_reward=NAN, **options):
        self.failures, self.yields, self.infra_reward = dict(failures or {}), dict(yields or {}), infra_reward
        self.options, self.calls, self.in_flight, self.max_in_flight, self.closed = options, {}, 0, 0, False
        self.finished = []

    async def verify(self, req):
        uid = req.item.uid
        self.calls[uid] = self.calls.get(uid, 0) + 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(self.yields.get(uid, 0)):
            await asyncio.sleep(0)
        self.in_flight -= 1
        self.finished.append(uid)
        if self.calls[uid] <= self.failures.get(uid, 0):
            return VerifyResult(VerifyStatus.INFRA_ERROR, self.infra_reward, "sandbox down")
        return VerifyResult(VerifyStatus.OK if uid.endswith("ok") else VerifyStatus.WRONG,
                            1.0 if uid.endswith("ok") else 0.0)

    def close(self):
        self.closed = True


class Sleeps:
    def __init__(self):
        self.delays = []

    async def __call__(self, seconds):
        self.delays.append(seconds)


def make_pool(fake, cfg=None, sleeps=None, metrics=None):
    return VerifierPool(cfg or VerifierConfig(), factories={"fake": lambda **o: fake}, sleep=sleeps or Sleeps(),
                        metrics=metrics)


def test_flaky_infra_error_is_retried_with_backoff_until_ok():
    fake, sleeps = FakeVerifier(failures={"a-ok": 2}), Sleeps()
    pool = make_pool(fake, VerifierConfig(backoff_base_s=0.5, backoff_max_s=0.8, jitter=0.5), sleeps)
    [result] = pool.verify_batch([request("a-ok")])
    assert result.status is VerifyStatus.OK and result.reward == 1.0
    assert fake.calls == {"a-ok": 3}
    # retry 0: 0.5 × U(0.5, 1); retry 1: min(0.8, 1.0) × U(0.5, 1)
    assert len(sleeps.delays) == 2
    assert 0.25 <= sleeps.delays[0] <= 0.5 and 0.4 <= sleeps.delays[1] <= 0.8
    stats = pool.stats()
    assert stats["status"] == {"ok": 1} and stats["attempts"] == 3 and stats["retries"] == 2


@pytest.mark.parametrize("retries", [0, 2, 3])
def test_persistent_infra_error_stays_nan_after_exactly_one_plus_retries_attempts(retries):
    fake, sleeps = FakeVerifier(failures={"b-ok": 99}, infra_reward=0.0), Sleeps()  # 0.0 breaks the contract
    pool = make_pool(fake, VerifierConfig(infra_retries=retries, jitter=0.0), sleeps)
    [result] = pool.verify_batch([request("b-ok")])
    assert result.status is VerifyStatus.INFRA_ERROR and math.isnan(result.reward)
    assert fake.calls == {"b-ok": 1 + retries}
    assert sleeps.delays == [min(8.0, 0.5 * 2 ** k) for k in range(retries)]  # no jitter: exact
    assert pool.stats()["status"] == {"infra_error": 1}


def test_results_keep_request_order_and_concurrency_stays_within_the_limit():
    uids = [f"r{i}-{'ok' if i % 3 else 'no'}" for i in range(12)]
    fake = FakeVerifier(yields={u: 12 - i for i, u in enumerate(uids)}, failures={uids[4]: 1})
    pool = make_pool(fake, VerifierConfig(max_concurrency=3))
    results = pool.verify_batch([request(u) for u in uids])
    assert fake.finished[:3] != uids[:3]  # they did finish out of order
    assert [r.status for r in results] == [VerifyStatus.OK if u.endswith("ok") else VerifyStatus.WRONG
                                           for u in uids]
    assert fake.max_in_flight == 3
    # a second batch reuses the same verifier and loop
    assert pool.verify_batch([request("x-ok")])[0].reward == 1.0
    assert pool.stats()["requests"] == 13 and pool.stats()["status"] == {"ok": 9, "wrong": 4}


def test_verifiers_are_built_lazily_once_per_name_with_their_options_and_closed():
    built = []

    def factory(**options):
        built.append(options)
        return FakeVerifier(**options)

    cfg = VerifierConfig(options=(("fake", "level", 2), ("math", "mode", "process")))
    pool = VerifierPool(cfg, factories={"fake": factory}, sleep=Sleeps())
    assert built == []
    pool.verify_batch([request("a-ok"), request("b-ok")])
    pool.verify_batch([request("c-ok")])
    assert built == [{"level": 2}]
    verifier = pool._verifiers["fake"]
    pool.close()
    assert verifier.closed
    with pytest.raises(KeyError, match="unknown verifier 'nope'"):
        pool.verify_batch([request("a", verifier="nope")])
    pool.close()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="max_concurrency"):
        VerifierConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="jitter"):
        VerifierConfig(jitter=1.5)
    with pytest.raises(ValueError, match="options"):
        VerifierConfig(options=(("math", "mode"),))


def test_results_and_latency_metrics_by_verifier_and_status():
    metrics = PrometheusMetrics()
    fake = FakeVerifier(failures={"c-ok": 1, "d-ok": 9})
    pool = make_pool(fake, VerifierConfig(infra_retries=1), metrics=metrics)
    pool.verify_batch([request(u) for u in ("a-ok", "b-no", "c-ok", "d-ok")])

    def value(name, status):
        return metrics.registry.get_sample_value(name, {"verifier": "fake", "status": status})

    assert [value("threepo_verifier_results_total", s) for s in ("ok", "wrong", "infra_error")] == [2, 1, 1]
    assert value("threepo_verifier_latency_seconds_count", "ok") == 2


def test_real_math_verifier_through_the_pool():
    pool = VerifierPool(VerifierConfig(max_concurrency=2))
    cases = [("\\boxed{81}", "81", VerifyStatus.OK), ("\\boxed{80}", "81", VerifyStatus.WRONG),
             ("81", "81", VerifyStatus.MALFORMED), ("so \\boxed{\\frac{1}{2}}", "0.5", VerifyStatus.OK)]
    results = pool.verify_batch([request(f"m{i}", "math", c, a) for i, (c, a, _) in enumerate(cases)])
    assert [r.status for r in results] == [s for _, _, s in cases]
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert pool.stats()["status"] == {"ok": 2, "wrong": 1, "malformed": 1}
    pool.close()


def test_a_request_repeated_in_a_batch_is_verified_once_and_answers_every_copy():
    fake = FakeVerifier(failures={"b": 1})
    pool = make_pool(fake, sleeps=Sleeps())
    batch = [request("a-ok", completion="x"), request("b", completion="x"), request("a-ok", completion="x"),
             request("a-ok", completion="y"), request("b", completion="x")]
    results = pool.verify_batch(batch)
    assert [r.status for r in results] == [VerifyStatus.OK, VerifyStatus.WRONG, VerifyStatus.OK, VerifyStatus.OK,
                                           VerifyStatus.WRONG]
    assert fake.calls == {"a-ok": 2, "b": 2}  # a-ok: texts x and y; b: one retry after its infra_error
    stats = pool.stats()
    assert stats["requests"] == 3 and stats["deduplicated"] == 2 and stats["retries"] == 1
    pool.verify_batch([request("a-ok", completion="x"), VerifyRequest(batch[0].item, "x", "length")])
    assert fake.calls["a-ok"] == 4  # another batch, and another finish reason, are verified afresh
