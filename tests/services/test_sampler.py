"""Sampler: completion ids, per-engine sequence numbers and weights checksums on the tiny checkpoint;
one serve per (version, seed) group; version mismatch; stats and metrics."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from threepo.services.engines.base import SamplerConfig
from threepo.services.engines.hf import HFEngine
from threepo.services.messages import PublishedVersion, RolloutRequest, TaskItem
from threepo.services.metrics import PrometheusMetrics
from threepo.services.posterior import PosteriorConfig, PosteriorServer
from threepo.services.sampler import Sampler


class CountingEngine:
    """Delegates to a real engine and records every serve and generate call."""

    def __init__(self, inner):
        self.inner, self.serves, self.generates = inner, [], []

    def update_posterior(self, version, mean, sigma):
        self.inner.update_posterior(version, mean, sigma)

    def serve(self, noise):
        self.serves.append(noise)
        return self.inner.serve(noise)

    def generate(self, prompts, params, seed=None):
        self.generates.append((list(prompts), params))
        return self.inner.generate(prompts, params, seed=seed)

    def close(self):
        self.inner.close()


CFG = SamplerConfig(max_new_tokens=6, temperature=0.9, top_k=20, seed=4)


@pytest.fixture(scope="module")
def hf_engine(tiny_dense_path):
    return HFEngine(tiny_dense_path, CFG, engine_id=7)


@pytest.fixture
def setup(hf_engine):
    """A fresh sampler over the shared engine, with version 1 of a 3-slot C3PO plan loaded."""
    mean = {n: p.detach().numpy().copy() for n, p in hf_engine._params.items()}
    server = PosteriorServer(PosteriorConfig(kind="c3po", group_size=6, n_slots=3, base_seed=1))
    server.publish(PublishedVersion(1, 0, "init", mean, {n: np.full(a.shape, 0.02) for n, a in mean.items()}))
    engine = CountingEngine(hf_engine)
    sampler = Sampler(engine, engine_id=7, cfg=CFG)
    sampler.update(1, *server.weights(1))
    return sampler, engine, server


def _requests(plan, slots, prompts=("Q: 1+2= A: ", "Q: 30*4= A: "), n=2, version=1):
    out = []
    for slot in slots:
        for k, prompt in enumerate(prompts):
            item = TaskItem(uid=f"p{k}", prompt=prompt, answer="3")
            out.append(RolloutRequest(request_id=f"g{k}/s{slot}", group_id=f"g{k}", item=item,
                                      policy_version=version, slot=slot, slot_seed=plan.slots[slot].seed, n=n))
    return out


def test_completions_carry_ids_seq_numbers_and_the_servers_checksum(setup):
    sampler, engine, server = setup
    plan = server.plan(1)
    requests = _requests(plan, slots=[0, 2])
    completions = sampler.generate(requests)
    assert [c.completion_id for c in completions] == [f"{r.request_id}/{j}" for r in requests for j in range(2)]
    assert [c.seq_no for c in completions] == list(range(8))
    for c, r in zip(completions, [r for r in requests for _ in range(2)]):
        assert (c.request_id, c.group_id, c.slot, c.prompt_uid) == (r.request_id, r.group_id, r.slot, r.item.uid)
        assert (c.engine_id, c.policy_version, c.slot_seed) == (7, 1, r.slot_seed)
        assert c.weights_checksum == server.expected_checksum(1, r.slot_seed)
        assert len(c.prompt_ids) == len(r.item.prompt) and 1 <= len(c.token_ids) == len(c.logprobs) <= 6
        assert c.finish_reason in ("stop", "length") and all(lp <= 0 for lp in c.logprobs)
    assert completions[0].weights_checksum != completions[4].weights_checksum  # slots 0 and 2 differ
    # a re-issued request gets the same ids and the next sequence numbers
    again = sampler.generate(requests[:1])
    assert [c.completion_id for c in again] == ["g0/s0/0", "g0/s0/1"]
    assert [c.seq_no for c in again] == [8, 9]
    stats = sampler.stats()
    assert stats["completions"] == 10 and stats["requests"] == 5 and stats["next_seq_no"] == 10
    assert stats["tokens_generated"] == sum(len(c.token_ids) for c in completions + again)
    assert stats["generate_s"] > 0 and stats["tokens_per_s"] > 0


def test_one_serve_and_one_generate_per_slot_group(setup):
    sampler, engine, server = setup
    plan = server.plan(1)
    # interleaved slots 1, 0, 1, 2, 0: three groups
    requests = [_requests(plan, [s], prompts=(p,))[0] for s, p in
                [(1, "a"), (0, "b"), (1, "c"), (2, "d"), (0, "e")]]
    completions = sampler.generate(requests)
    assert [s.seed for s in engine.serves] == [plan.slots[i].seed for i in (1, 0, 2)]
    assert [g[0] for g in engine.generates] == [["a", "c"], ["b", "e"], ["d"]]
    assert all(params.n == 2 and params.max_new_tokens == 6 and params.temperature == 0.9
               and params.top_k == 20 for _, params in engine.generates)
    assert [c.completion_id.split("/")[0] for c in completions[::2]] == ["g0"] * 5  # request order kept
    by_seed = defaultdict(set)
    for c in completions:
        by_seed[c.slot_seed].add(c.weights_checksum)
    assert all(len(v) == 1 for v in by_seed.values()) and len(by_seed) == 3
    # the engine still serves slot 2: a batch for slot 2 needs no new serve, one for slot 1 does
    sampler.generate(_requests(plan, [2], prompts=("f",)))
    assert len(engine.serves) == 3
    sampler.generate(_requests(plan, [1], prompts=("g",)))
    assert len(engine.serves) == 4
    # a new version resets what is served
    sampler.update(2, *server.weights(1))
    sampler.generate(_requests(plan, [1], prompts=("h",), version=2))
    assert len(engine.serves) == 5 and engine.serves[-1].posterior_version == 2


def test_requests_of_one_slot_with_different_n_share_the_serve(setup):
    sampler, engine, server = setup
    plan = server.plan(1)
    requests = _requests(plan, [0], prompts=("a",), n=1) + _requests(plan, [0], prompts=("b",), n=3)
    completions = sampler.generate(requests)
    assert len(engine.serves) == 1 and [p.n for _, p in engine.generates] == [1, 3]
    assert [c.completion_id for c in completions] == ["g0/s0/0", "g0/s0/0", "g0/s0/1", "g0/s0/2"]


def test_a_request_for_another_version_is_refused_before_any_work(setup, hf_engine):
    sampler, engine, server = setup
    plan = server.plan(1)
    requests = _requests(plan, [0]) + _requests(plan, [1], version=2)
    with pytest.raises(ValueError, match=r"policy_version 2.*holds version 1"):
        sampler.generate(requests)
    assert engine.serves == [] and engine.generates == [] and sampler.stats()["next_seq_no"] == 0
    fresh = Sampler(CountingEngine(hf_engine), engine_id=1, cfg=CFG)
    with pytest.raises(ValueError, match="holds version None: update first"):
        fresh.generate(_requests(plan, [0]))



def test_a_reissued_request_draws_the_same_tokens(setup):
    sampler, _, server = setup
    requests = _requests(server.plan(1), [0, 1])
    first = sampler.generate(requests)
    sampler.generate(_requests(server.plan(1), [2], prompts=("other",)))  # the engine's stream moves on
    again = sampler.generate(requests)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert [c.completion_id for c in again] == [c.completion_id for c in first]


def test_metrics_follow_the_stats(setup):
    _, engine, server = setup
    metrics = PrometheusMetrics()
    sampler = Sampler(engine, engine_id=3, cfg=CFG, metrics=metrics)
    sampler.update(1, *server.weights(1))
    completions = sampler.generate(_requests(server.plan(1), [0]))

    def value(name):
        return metrics.registry.get_sample_value(name, {"engine_id": "3"})

    assert value("threepo_completions_total") == len(completions) == 4
    assert value("threepo_tokens_generated_total") == sum(len(c.token_ids) for c in completions)
    assert value("threepo_sync_bytes_total") == server.bytes_of(1) == sampler.stats()["sync_bytes"]
    assert value("threepo_sync_seconds_count") == 1
