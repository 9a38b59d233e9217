"""The learner in-process (no Ray): gradient points per exploration, publishing, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from threepo.algorithms.exploration import make_plan
from threepo.services.engines.base import SamplerConfig
from threepo.services.engines.hf import HFEngine
from threepo.services.learner import Learner
from threepo.services.learner_config import AlgoConfig, OptimConfig, SyncConfig
from threepo.services.messages import (Completion, Group, NoiseSpec, SamplingParams, ScoredCompletion,
                                       VerifyResult, VerifyStatus)
from threepo.services.tasks import generate_items


def _groups(engine, learner, exploration, n_slots, group_size, rewards_seed=0):
    """Real completions from the engine at the learner's published version, with synthetic rewards."""
    pv = learner.published()
    engine.update_posterior(pv.version, pv.mean, pv.sigma)
    plan = make_plan(exploration, version=pv.version, base_seed=0, group_size=group_size, n_slots=n_slots)
    gen = torch.Generator().manual_seed(rewards_seed)
    groups = []
    for item in generate_items("arith", "train", 3, seed=1):
        by_group: dict[int, list] = {}
        for slot in plan.slots:
            checksum = engine.serve(NoiseSpec(pv.version, slot.seed))
            samples = engine.generate([item.prompt], SamplingParams(max_new_tokens=10, n=plan.rollouts_per_slot),
                                      seed=slot.index)[0]
            for j, s in enumerate(samples):
                c = Completion(completion_id=f"{item.uid}/{slot.index}/{j}", request_id="r", group_id=item.uid,
                               slot=slot.index, prompt_uid=item.uid, engine_id=0, seq_no=0,
                               policy_version=pv.version, slot_seed=slot.seed, weights_checksum=checksum,
                               prompt_ids=s.prompt_ids, token_ids=s.token_ids, logprobs=s.logprobs,
                               finish_reason=s.finish_reason, text=s.text)
                reward = float(torch.rand((), generator=gen) < 0.5)
                status = VerifyStatus.OK if reward else VerifyStatus.WRONG
                by_group.setdefault(plan.group_of(slot.index), []).append(ScoredCompletion(c, VerifyResult(status, reward)))
        groups += [Group(f"{item.uid}/g{g}", item, pv.version, 0, tuple(v)) for g, v in by_group.items()]
    return groups


@pytest.fixture(scope="module")
def engine(tiny_dense_path):
    return HFEngine(tiny_dense_path, SamplerConfig())


def _learner(path, exploration="c3po", n_slots=4, **algo):
    return Learner(path, AlgoConfig(exploration=exploration, n_slots=n_slots, group_size=8, **algo),
                   OptimConfig(), SyncConfig(max_staleness=2), temperature=1.0, max_new_tokens=10)


@pytest.mark.parametrize("exploration,n_slots,points", [("c3po", 4, 1), ("m3po", 2, 2), ("b3po", 1, 1),
                                                        ("grpo", 1, 1)])
def test_one_step_takes_the_gradient_where_the_plan_says(engine, tiny_dense_path, exploration, n_slots, points):
    learner = _learner(tiny_dense_path, exploration, n_slots)
    groups = _groups(engine, learner, exploration, n_slots, 8)
    batch = learner._collate(groups)
    assert len(learner._gradient_points(batch)) == points
    before = {n: t.clone() for n, t in learner.opt.mean_by_name().items()}
    result = learner.step(groups)
    moved = max(float((learner.opt.mean_by_name()[n] - before[n]).abs().max()) for n in before)
    o = learner.optim_cfg  # a step moves each weight by at most α·ξ, α = lr·(h0 + δ) (clip radius ξ)
    ulp = max(float(t.abs().max()) for t in before.values()) * torch.finfo(torch.float32).eps  # fp32 rounding
    assert 0 < moved <= o.lr * (o.hess_init + o.weight_decay) * o.clip_radius + ulp
    assert result.step == 1 and all(math.isfinite(v) for v in result.metrics.values())
    assert result.publish_version is None  # κ/η not crossed on the first step, max_staleness = 2
    assert learner.step(groups).publish_version == 1 and learner.version == 1


def test_c3po_gradient_is_at_a_fresh_sample_that_changes_every_step(engine, tiny_dense_path):
    learner = _learner(tiny_dense_path)
    batch = learner._collate(_groups(engine, learner, "c3po", 4, 8))
    (seed0, _), = learner._gradient_points(batch)
    learner.step_count += 1
    (seed1, _), = learner._gradient_points(batch)
    assert seed0 != seed1 and seed0 not in {c for c in batch.slot_seeds}


def test_importance_weights_are_capped_and_infra_errors_rejected(engine, tiny_dense_path):
    learner = _learner(tiny_dense_path, is_cap=1.5)
    groups = _groups(engine, learner, "c3po", 4, 8)
    assert learner.step(groups).metrics["is_weight_mean"] <= 1.5
    bad = groups[0].completions[0]
    broken = ScoredCompletion(bad.completion, VerifyResult(VerifyStatus.INFRA_ERROR, float("nan")))
    poisoned = [Group(groups[0].group_id, groups[0].item, 0, 0, (broken,) + groups[0].completions[1:])]
    with pytest.raises(ValueError, match="infra_error"):
        learner.step(poisoned)


def test_state_round_trip_continues_identically(engine, tiny_dense_path):
    a = _learner(tiny_dense_path, advantage="lampo")
    groups = _groups(engine, a, "c3po", 4, 8)
    a.step(groups)
    tensors, meta = a.state()
    b = _learner(tiny_dense_path, advantage="lampo")
    b.load_state({k: v.clone() for k, v in tensors.items()}, meta)
    ra, rb = a.step(groups), b.step(groups)
    assert ra.step == rb.step == 2
    for key in ("loss", "kl_k3", "ess_frac", "advantage_mean"):
        assert ra.metrics[key] == pytest.approx(rb.metrics[key], abs=1e-7), key
    for n, t in a.opt.mean_by_name().items():
        assert torch.equal(t, b.opt.mean_by_name()[n]), n
