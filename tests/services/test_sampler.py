"""Sampler: completion ids, per-engine sequence numbers and the weight check on the tiny checkpoint;
one serve per (version, seed) group; version mismatch; corrupted weights flagged; served-noise ratio;
stats and metrics."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict

import numpy as np
import pytest
import torch

from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.metrics import PrometheusMetrics
from threepo.services.model.tokenizer import build_tokenizer
from threepo.services.posterior import PosteriorConfig, PosteriorServer
from threepo.services.sampling.engines.base import SamplerConfig, WeightsMismatch
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.sampling.sampler import Sampler
from threepo.services.tasks.prompting import PromptConfig, PromptEncoder
from threepo.services.wire.batching import completions_of
from threepo.services.wire.messages import PublishedVersion, RolloutRequest, TaskItem

PROMPTS = PromptEncoder(build_tokenizer(), PromptConfig())  # the tiny checkpoint's tokenizer: raw text


class CountingEngine:
    """Delegates to a real engine and records every serve and generate call."""

    def __init__(self, inner):
        self.inner, self.serves, self.generates = inner, [], []

    def load_version(self, version, mean, sigma, mean_checksum, noise_rank=0):
        self.inner.load_version(version, mean, sigma, mean_checksum)

    def serve(self, noise):
        self.serves.append(noise)
        return self.inner.serve(noise)

    def generate(self, requests, params):
        self.generates.append(([self.inner.tokenizer.decode(r.prompt_ids) for r in requests],
                               [r.n for r in requests], params))
        return self.inner.generate(requests, params)

    def verify(self):
        return self.inner.verify()

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
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    server = PosteriorServer(PosteriorConfig(kind="c3po", group_size=6, n_slots=3, equal_compute=True, base_seed=1))
    for _ in range(2):  # versions 0 and 1
        server.publish(PublishedVersion(0, "init", mean, {n: np.full(a.shape, 0.02) for n, a in mean.items()},
                                        checksum))
    engine = CountingEngine(hf_engine)
    sampler = Sampler(engine, prompts=PROMPTS, engine_id=7, cfg=CFG)
    sampler.update(1, *server.weights(1))
    return sampler, engine, server


def _gen(sampler, requests):
    """The sampler's array batch, as record-form completions."""
    return completions_of(sampler.generate(requests))


def _requests(plan, slots, prompts=("Q: 1+2= A: ", "Q: 30*4= A: "), n=2, version=1):
    out = []
    for slot in slots:
        for k, prompt in enumerate(prompts):
            item = TaskItem(uid=f"p{k}", prompt=prompt, answer="3")
            out.append(RolloutRequest(request_id=f"g{k}/s{slot}", group_id=f"g{k}", item=item,
                                      policy_version=version, slot=slot, slot_seed=plan.slots[slot].seed, n=n))
    return out


def test_completions_carry_ids_seq_numbers_and_the_published_mean_checksum(setup):
    sampler, engine, server = setup
    plan = server.version_plan(1).plan
    requests = _requests(plan, slots=[0, 2])
    completions = _gen(sampler, requests)
    assert [c.completion_id for c in completions] == [f"{r.request_id}/{j}" for r in requests for j in range(2)]
    assert [c.seq_no for c in completions] == list(range(8))
    for c, r in zip(completions, [r for r in requests for _ in range(2)]):
        assert (c.request_id, c.group_id, c.slot, c.prompt_uid) == (r.request_id, r.group_id, r.slot, r.item.uid)
        assert (c.engine_id, c.policy_version, c.slot_seed) == (7, 1, r.slot_seed)
        assert c.mean_checksum == server.version_plan(1).mean_checksum and c.weights_verified
        assert len(c.prompt_ids) == len(r.item.prompt) and 1 <= len(c.token_ids) == len(c.logprobs) <= 6
        assert c.finish_reason in ("stop", "length") and all(lp <= 0 for lp in c.logprobs)
    assert completions[0].logprobs != completions[4].logprobs  # slots 0 and 2 are different policies
    # a re-issued request gets the same ids and the next sequence numbers
    again = _gen(sampler, requests[:1])
    assert [c.completion_id for c in again] == ["g0/s0/0", "g0/s0/1"]
    assert [c.seq_no for c in again] == [8, 9]
    stats = sampler.stats()
    assert stats["completions"] == 10 and stats["requests"] == 5 and stats["next_seq_no"] == 10
    assert stats["tokens_generated"] == sum(len(c.token_ids) for c in completions + again)
    assert stats["generate_s"] > 0 and stats["tokens_per_s"] > 0


def test_a_scaled_slot_is_its_own_serve_and_its_completions_carry_the_scale(setup):
    sampler, engine, server = setup
    plan = server.version_plan(1).plan
    base = _requests(plan, [0], prompts=("a", "b"))
    hot = [dataclasses.replace(r, slot_scale=2.0) for r in base]  # same ids: the same sampling streams
    completions = _gen(sampler, [base[0], hot[0], base[1], hot[1]])
    assert [(n.seed, n.scale) for n in engine.serves] == [(plan.slots[0].seed, 1.0), (plan.slots[0].seed, 2.0)]
    assert [g[0] for g in engine.generates] == [["a", "b"], ["a", "b"]]
    assert [c.slot_scale for c in completions] == [1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]
    assert completions[0].logprobs != completions[2].logprobs  # same seed, prompt and stream: other policies
    assert all(c.weights_verified for c in completions)


def test_one_serve_and_one_generate_per_slot_group(setup):
    sampler, engine, server = setup
    plan = server.version_plan(1).plan
    # interleaved slots 1, 0, 1, 2, 0: three groups
    requests = [_requests(plan, [s], prompts=(p,))[0] for s, p in
                [(1, "a"), (0, "b"), (1, "c"), (2, "d"), (0, "e")]]
    completions = _gen(sampler, requests)
    assert [s.seed for s in engine.serves] == [plan.slots[i].seed for i in (1, 0, 2)]
    assert [g[0] for g in engine.generates] == [["a", "c"], ["b", "e"], ["d"]]
    assert all(ns == [2] * len(ns) and params.max_new_tokens == 6 and params.temperature == 0.9
               and params.top_k == 20 for _, ns, params in engine.generates)
    assert [c.completion_id.split("/")[0] for c in completions[::2]] == ["g0"] * 5  # request order kept
    by_seed = defaultdict(set)
    for c in completions:
        by_seed[c.slot_seed].add((c.mean_checksum, c.weights_verified))
    assert all(v == {(server.version_plan(1).mean_checksum, True)} for v in by_seed.values()) and len(by_seed) == 3
    # the engine still serves slot 2: a batch for slot 2 needs no new serve, one for slot 1 does
    _gen(sampler, _requests(plan, [2], prompts=("f",)))
    assert len(engine.serves) == 3
    _gen(sampler, _requests(plan, [1], prompts=("g",)))
    assert len(engine.serves) == 4
    # a new version resets what is served
    sampler.update(2, *server.weights(1))
    _gen(sampler, _requests(plan, [1], prompts=("h",), version=2))
    assert len(engine.serves) == 5 and engine.serves[-1].posterior_version == 2


def test_requests_of_one_slot_with_different_n_share_the_serve(setup):
    sampler, engine, server = setup
    plan = server.version_plan(1).plan
    requests = _requests(plan, [0], prompts=("a",), n=1) + _requests(plan, [0], prompts=("b",), n=3)
    completions = _gen(sampler, requests)
    assert len(engine.serves) == 1 and [ns for _, ns, _ in engine.generates] == [[1, 3]]
    assert [c.completion_id for c in completions] == ["g0/s0/0", "g0/s0/0", "g0/s0/1", "g0/s0/2"]


def test_a_request_for_another_version_is_refused_before_any_work(setup, hf_engine):
    sampler, engine, server = setup
    plan = server.version_plan(1).plan
    requests = _requests(plan, [0]) + _requests(plan, [1], version=2)
    with pytest.raises(ValueError, match=r"policy_version 2.*holds version 1"):
        _gen(sampler, requests)
    assert engine.serves == [] and engine.generates == [] and sampler.stats()["next_seq_no"] == 0
    fresh = Sampler(CountingEngine(hf_engine), prompts=PROMPTS, engine_id=1, cfg=CFG)
    with pytest.raises(ValueError, match="holds version None: update first"):
        _gen(fresh, _requests(plan, [0]))



def test_a_reissued_request_draws_the_same_tokens(setup):
    sampler, _, server = setup
    requests = _requests(server.version_plan(1).plan, [0, 1])
    first = _gen(sampler, requests)
    _gen(sampler, _requests(server.version_plan(1).plan, [2], prompts=("other",)))  # the engine moves on
    again = _gen(sampler, requests[::-1])  # and the batch is composed differently
    by_id = {c.completion_id: c.token_ids for c in again}
    assert [by_id[c.completion_id] for c in first] == [c.token_ids for c in first]
    assert sorted(by_id) == sorted(c.completion_id for c in first)


def test_metrics_follow_the_stats(setup):
    _, engine, server = setup
    metrics = PrometheusMetrics()
    sampler = Sampler(engine, prompts=PROMPTS, engine_id=3, cfg=CFG, metrics=metrics)
    sampler.update(1, *server.weights(1))
    completions = _gen(sampler, _requests(server.version_plan(1).plan, [0]))

    def value(name):
        return metrics.registry.get_sample_value(name, {"engine_id": "3"})

    assert value("threepo_completions_total") == len(completions) == 4
    assert value("threepo_tokens_generated_total") == sum(len(c.token_ids) for c in completions)
    assert value("threepo_sync_bytes_total") == server.bytes_of(1) == sampler.stats()["sync_bytes"]
    assert value("threepo_sync_seconds_count") == 1


def test_weights_corrupted_while_serving_are_flagged_and_reloaded(setup):
    sampler, engine, server = setup
    metrics = PrometheusMetrics()
    sampler = Sampler(engine, prompts=PROMPTS, engine_id=5, cfg=CFG, metrics=metrics)
    sampler.update(1, *server.weights(1))
    requests = _requests(server.version_plan(1).plan, [1])
    assert all(c.weights_verified for c in _gen(sampler, requests))
    with torch.no_grad():
        next(iter(engine.inner.served().values())).view(-1)[3] += 1e-3  # a stray write into served weights
    flagged = _gen(sampler, requests)
    assert not any(c.weights_verified for c in flagged)
    assert metrics.registry.get_sample_value("threepo_weight_check_failures_total",
                                             {"engine_id": "5", "reason": "changed"}) == 1
    healed = _gen(sampler, requests)  # the slot is loaded afresh from m and σ
    assert all(c.weights_verified for c in healed) and len(engine.serves) == 2


def test_a_mean_that_is_not_the_published_one_is_refused(setup):
    sampler, _, server = setup
    mean, sigma, checksum = server.weights(1)
    with pytest.raises(WeightsMismatch):
        sampler.update(2, {n: a * 1.5 for n, a in mean.items()}, sigma, checksum)
    assert sampler.version == 1 and sampler.stats()["weight_check_failures"] == 1


def test_noise_lost_to_bf16_is_measured_and_warned_about(tiny_dense_path, caplog):
    bf16 = HFEngine(tiny_dense_path, SamplerConfig(dtype="bfloat16", seed=4))
    mean = {n: p.detach().float().numpy().copy() for n, p in bf16._params.items()}
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    metrics = PrometheusMetrics()
    sampler = Sampler(bf16, prompts=PROMPTS, engine_id=2, cfg=SamplerConfig(dtype="bfloat16", max_new_tokens=4),
                      metrics=metrics)
    tiny_sigma = {n: np.full(a.shape, 1e-6, np.float32) for n, a in mean.items()}  # far below bf16 spacing
    sampler.update(1, mean, tiny_sigma, checksum)
    item = TaskItem(uid="p", prompt="Q: 1+2= A: ", answer="3")
    with caplog.at_level(logging.WARNING):
        _gen(sampler, [RolloutRequest("g/s0", "g", item, 1, 0, 77, 1)])
    ratio = metrics.registry.get_sample_value("threepo_served_noise_ratio", {"engine_id": "2"})
    assert ratio < 0.5 and "exploration noise survives" in caplog.text
    fp32 = Sampler(HFEngine(tiny_dense_path, SamplerConfig(seed=4)), prompts=PROMPTS, engine_id=3,
                   cfg=SamplerConfig(max_new_tokens=4))
    fp32.update(1, mean, tiny_sigma, checksum)
    _gen(fp32, [RolloutRequest("g/s0", "g", item, 1, 0, 77, 1)])
    assert fp32.stats()["noise_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_an_engine_with_generate_slots_decodes_a_calls_slots_together_with_the_same_draws(setup, hf_engine):
    counting, engine, server = setup  # CountingEngine has no slots_together: one serve and generate per slot
    plan = server.version_plan(1).plan
    requests = _requests(plan, [0, 2, 1])
    one_by_one = _gen(counting, requests)
    together = Sampler(hf_engine, prompts=PROMPTS, engine_id=7, cfg=CFG)
    together.update(1, *server.weights(1))
    serves_before = together.stats()["serves"]
    joint = _gen(together, requests)
    assert together.stats()["serves"] == serves_before  # no slot was copied into the model
    assert [c.completion_id for c in joint] == [c.completion_id for c in one_by_one]
    assert [c.token_ids for c in joint] == [c.token_ids for c in one_by_one]
    for a, b in zip(joint, one_by_one):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.weights_verified and a.mean_checksum == server.version_plan(1).mean_checksum
    assert together.stats()["noise_ratio"] == pytest.approx(1.0, abs=1e-3)
