"""The learner in-process (no Ray): gradient points per exploration, PPO updates against the start-of-step
policy, losses, the dynamic filter, LamPO's common policy, drift diagnostics, publishing, state round trip."""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np
import pytest
import torch

from threepo.algorithms import advantages as adv_math
from threepo.algorithms import losses
from threepo.algorithms.exploration import make_plan, update_seed
from threepo.algorithms.noise_mask import NoiseConfig, noised_names
from threepo.algorithms.param_noise import perturbed_state
from threepo.services.learner.config import AlgoConfig
from threepo.services.learner.core import Learner
from threepo.services.learner.objective import make_estimator
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters
from threepo.services.tasks.synthetic import generate_items
from threepo.services.wire.batching import batches_from_groups, collate
from threepo.services.wire.messages import Completion, Group, ScoredCompletion, VerifyResult, VerifyStatus


def _sample(model, tokenizer, prompt: str, n: int, gen: torch.Generator, max_new_tokens: int = 10):
    """`n` completions of `prompt` at T = 1 with their behaviour log-probs (a full forward per token)."""
    prompt_ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([prompt_ids] * n)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            ids = torch.cat([ids, torch.multinomial(logp.exp(), 1, generator=gen)], dim=1)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, len(prompt_ids) - 1:-1].float(), dim=-1)
    out = []
    for row, lp in zip(ids[:, len(prompt_ids):].tolist(), logp):
        cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        tokens = tuple(row[:cut])
        out.append((prompt_ids, tokens, tuple(float(lp[t, x]) for t, x in enumerate(tokens)),
                    "stop" if cut < len(row) or row[-1] == tokenizer.eos_token_id else "length",
                    tokenizer.decode(list(tokens))))
    return out


@pytest.fixture(scope="module")
def sampler(tiny_dense_path):
    """A tiny-model copy that samples at any published θ̂ = m + σ ⊙ z(seed) (the engines' rule)."""
    return load_model(tiny_dense_path).eval(), load_tokenizer(tiny_dense_path)


def _step(learner, groups):
    """A learner step on record-form groups, through the array path the runtime uses."""
    return learner.step(*batches_from_groups(groups))


def _groups(sampler, learner, exploration, n_slots, group_size, rewards_seed=0, scale=1.0, reported_scale=None):
    """Completions sampled at the learner's published version, slot by slot (its slots' σ scale
    multiplied by `scale`, and tagged with `reported_scale`, default the same), with synthetic rewards."""
    model, tokenizer = sampler
    pv = learner.published()
    mean = {n: torch.from_numpy(a) for n, a in pv.mean.items()}
    sigma = {n: torch.from_numpy(a) for n, a in pv.sigma.items()} if pv.sigma else {}
    plan = make_plan(exploration, version=0, base_seed=0, group_size=group_size, n_slots=n_slots)
    plan = plan.with_slots(pv.slots) if pv.slots else plan  # the noise control's seeds and scale
    gen = torch.Generator().manual_seed(rewards_seed)
    groups = []
    for item in generate_items("arith", "train", 3, seed=1):
        by_group: dict[int, list] = {}
        for slot in plan.slots:
            theta = perturbed_state(mean, sigma, slot.seed, scale * slot.scale, rank=pv.noise_rank)
            with torch.no_grad():
                for name, p in trainable_named_parameters(model):
                    p.copy_(theta[name])
            for j, (prompt_ids, tokens, logprobs, finish, text) in enumerate(
                    _sample(model, tokenizer, item.prompt, plan.rollouts_per_slot, gen)):
                c = Completion(completion_id=f"{item.uid}/{slot.index}/{j}", request_id=f"{item.uid}/s{slot.index}", group_id=item.uid,
                               slot=slot.index, prompt_uid=item.uid, engine_id=0, seq_no=0,
                               policy_version=0, slot_seed=slot.seed, mean_checksum=pv.mean_checksum,
                               weights_verified=True, prompt_ids=prompt_ids, token_ids=tokens,
                               logprobs=logprobs, finish_reason=finish, text=text,
                               slot_scale=(scale if reported_scale is None else reported_scale) * slot.scale)
                reward = float(torch.rand((), generator=gen) < 0.5)
                status = VerifyStatus.OK if reward else VerifyStatus.WRONG
                by_group.setdefault(plan.group_of(slot.index), []).append(ScoredCompletion(c, VerifyResult(status, reward)))
        groups += [Group(f"{item.uid}/g{g}", item, 0, 0, tuple(v)) for g, v in by_group.items()]
    return groups


def _learner(path, exploration="c3po", n_slots=4, optim=None, sync=None, drift_process=False, **algo):
    return Learner(path, AlgoConfig(exploration=exploration, n_slots=n_slots, group_size=8, **algo),
                   optim or OptimConfig(), sync or SyncConfig(max_staleness=2), temperature=1.0, max_new_tokens=10,
                   drift_process=drift_process)


def _train_seeds(learner) -> list:
    """Records the seed of every IVON training sample the learner takes (sampled_params, train=True)."""
    seen, original = [], learner.optimizer.ivon.sampled_params

    def spy(seed, train=True, scale=1.0, sigma=None, rank=0):
        if train:
            seen.append(seed)
        return original(seed, train, scale, sigma, rank)
    learner.optimizer.ivon.sampled_params = spy
    return seen


def _rescored(group, rewards):
    """`group` with the given rewards (1 = ok, 0 = wrong)."""
    done = tuple(ScoredCompletion(s.completion, VerifyResult(VerifyStatus.OK if r else VerifyStatus.WRONG, float(r)))
                 for s, r in zip(group.completions, rewards))
    return Group(group.group_id, group.item, group.policy_version, group.published_step, done)


def _means(learner):
    return {n: t.clone() for n, t in learner.optimizer.ivon.mean_by_name().items()}


@pytest.mark.parametrize("exploration,n_slots,points", [("c3po", 4, 1), ("m3po", 2, 2), ("b3po", 1, 1),
                                                        ("none", 1, 1)])
def test_one_step_takes_the_gradient_where_the_plan_says(sampler, tiny_dense_path, exploration, n_slots, points):
    learner = _learner(tiny_dense_path, exploration, n_slots)
    groups = _groups(sampler, learner, exploration, n_slots, 8)
    batch = collate(*batches_from_groups(groups))
    (update,) = learner._updates(batch, torch.ones(len(groups), dtype=torch.bool))  # one update by default
    assert len(update) == points
    before = {n: t.clone() for n, t in learner.optimizer.ivon.mean_by_name().items()}
    result = _step(learner, groups)
    moved = max(float((learner.optimizer.ivon.mean_by_name()[n] - before[n]).abs().max()) for n in before)
    o = learner.optim_cfg  # a step moves each weight by at most α·ξ, α = lr·(h0 + δ) (clip radius ξ)
    ulp = max(float(t.abs().max()) for t in before.values()) * torch.finfo(torch.float32).eps  # fp32 rounding
    assert 0 < moved <= o.lr * (o.hess_init + o.weight_decay) * o.clip_radius + ulp
    assert result.step == 1 and all(math.isfinite(v) for v in result.metrics.values())
    assert not result.publish  # κ/η not crossed on the first step, max_staleness = 2
    assert _step(learner, groups).publish and learner.published().learner_step == 2


def test_c3po_gradient_is_at_a_fresh_sample_that_changes_every_step(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path)
    batch = collate(*batches_from_groups(_groups(sampler, learner, "c3po", 4, 8)))
    keep = torch.ones(3, dtype=torch.bool)
    ((seed0, _),), = learner._updates(batch, keep)
    learner.step_count += 1
    ((seed1, _),), = learner._updates(batch, keep)
    assert seed0 != seed1 and seed0 not in {c for c in batch.slot_seeds}


def test_importance_weights_are_capped_and_infra_errors_rejected(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, is_cap=1.5)
    groups = _groups(sampler, learner, "c3po", 4, 8)
    assert _step(learner, groups).metrics["is_weight_mean"] <= 1.5
    bad = groups[0].completions[0]
    broken = ScoredCompletion(bad.completion, VerifyResult(VerifyStatus.INFRA_ERROR, float("nan")))
    poisoned = [Group(groups[0].group_id, groups[0].item, 0, 0, (broken,) + groups[0].completions[1:])]
    with pytest.raises(ValueError, match="infra_error"):
        _step(learner, poisoned)


def test_state_round_trip_continues_identically(sampler, tiny_dense_path):
    a = _learner(tiny_dense_path, advantage="lampo")
    groups = _groups(sampler, a, "c3po", 4, 8)
    _step(a, groups)
    tensors, meta = a.state()
    b = _learner(tiny_dense_path, advantage="lampo")
    b.load_state({k: v.clone() for k, v in tensors.items()}, meta)
    ra, rb = _step(a, groups), _step(b, groups)
    assert ra.step == rb.step == 2
    for key in ("loss", "kl_k3", "ess_frac", "advantage_mean"):
        assert ra.metrics[key] == pytest.approx(rb.metrics[key], abs=1e-7), key
    for n, t in a.optimizer.ivon.mean_by_name().items():
        assert torch.equal(t, b.optimizer.ivon.mean_by_name()[n]), n


@pytest.mark.parametrize("exploration,n_slots", [("b3po", 1), ("m3po", 2)])
def test_b3po_and_m3po_take_every_step_at_fresh_samples(sampler, tiny_dense_path, exploration, n_slots):
    # IVON's Price estimate and B3PO need a new z per step: a slot's seed lives as long as its version
    learner = _learner(tiny_dense_path, exploration, n_slots)
    groups = _groups(sampler, learner, exploration, n_slots, 8)
    slot_seeds = {s.completion.slot_seed for g in groups for s in g.completions}
    seen = _train_seeds(learner)
    _step(learner, groups)
    first = list(seen)
    _step(learner, groups)  # the same rollouts again, as a stale version's would be
    second = seen[len(first):]
    assert len(first) == len(second) == n_slots  # M3PO: one Monte-Carlo sample per slot group
    assert None not in first and not (set(first) | set(second)) & slot_seeds
    assert not set(first) & set(second)


def test_grpo_with_ivon_takes_its_gradient_at_a_sample_so_h_keeps_an_estimate(sampler, tiny_dense_path):
    # at the mean the Price estimate is 0 and h can only decay: h_new = β2 h + ½(1−β2)² h²/(h+δ) < h
    learner = _learner(tiny_dense_path, "none", 1)
    groups = _groups(sampler, learner, "none", 1, 8)
    seen = _train_seeds(learner)
    before = {n: t.clone() for n, t in learner.optimizer.ivon.hess_by_name().items()}
    _step(learner, groups)
    assert seen and None not in seen
    assert any(bool((learner.optimizer.ivon.hess_by_name()[n] > h).any()) for n, h in before.items())


def test_one_update_per_batch_leaves_the_clip_inert(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, "none", 1, optim=OptimConfig(name="adamw", lr=3e-3))
    result = _step(learner, _groups(sampler, learner, "none", 1, 8))
    assert result.metrics["updates"] == 1 and result.metrics["clip_frac"] == 0.0


def test_mini_batches_update_against_the_start_of_step_policy_so_the_clips_act(sampler, tiny_dense_path):
    # 3 mini-batches × 2 epochs = 6 AdamW steps; every ratio is against the policy before the first
    learner = _learner(tiny_dense_path, "none", 1, optim=OptimConfig(name="adamw", lr=3e-3), mini_batches=3,
                       ppo_epochs=2, eps_low=1e-3, eps_high=1e-3, is_correction="none")
    groups = _groups(sampler, learner, "none", 1, 8)
    result = _step(learner, groups)
    assert result.metrics["updates"] == 6 and learner.optimizer.torch.state_dict()["state"][0]["step"] == 6
    assert result.metrics["clip_frac"] > 0.1 and result.metrics["ppo_kl"] != 0.0


def test_ivon_mini_batches_are_optimizer_steps_each_at_a_fresh_sample(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, "c3po", 4, mini_batches=3)
    groups = _groups(sampler, learner, "c3po", 4, 8)
    seen = _train_seeds(learner)
    result = _step(learner, groups)
    assert learner.optimizer.ivon.param_groups[0]["step"] == 3 and len(set(seen)) == 3
    assert seen == [update_seed(0, 0, u, 0) for u in range(3)]
    assert result.metrics["ppo_kl"] != 0.0  # later mini-batches see ratios ≠ 1


@pytest.mark.parametrize("loss,is_correction,key", [("decoupled_ppo", "none", "behav_mask_frac"),
                                                    ("kl_cov", "seq_tis", "kl_cov_frac")])
def test_decoupled_ppo_and_kl_cov_are_reachable(sampler, tiny_dense_path, loss, is_correction, key):
    extra = {"kl_cov_ratio": 0.2} if loss == "kl_cov" else {}
    learner = _learner(tiny_dense_path, "c3po", 4, loss=loss, is_correction=is_correction, mini_batches=2, **extra)
    result = _step(learner, _groups(sampler, learner, "c3po", 4, 8))
    assert key in result.metrics and all(math.isfinite(v) for v in result.metrics.values())
    if loss == "kl_cov":
        assert result.metrics["kl_cov_frac"] == pytest.approx(0.2, abs=0.02) and result.metrics["ppo_kl_abs"] > 0


@pytest.mark.parametrize("overrides,word", [
    (dict(loss="decoupled_ppo"), "algo.is_correction"),
    (dict(eps_high=0.28), "algo.eps_high"),  # one update per batch: the ratio is 1, the clip never acts
    (dict(dual_clip_c=3.0), "algo.dual_clip_c"),
    (dict(kl_cov_ratio=0.2), "algo.kl_cov_ratio"),
    (dict(loss="kl_cov", mini_batches=2, eps_high=0.28), "algo.eps_high"),
    (dict(mini_batches=0), "algo.mini_batches"),
    (dict(ppo_epochs=0), "algo.ppo_epochs"),
    (dict(loss="trpo"), "algo.loss"),
])
def test_algo_config_rejects_knobs_that_would_do_nothing(overrides, word):
    with pytest.raises(ValueError, match=word):
        AlgoConfig(**overrides)
    AlgoConfig(eps_high=0.28, dual_clip_c=3.0, mini_batches=2)  # with two updates they act


def test_dynamic_filter_leaves_equal_reward_groups_out_of_the_update(sampler, tiny_dense_path):
    base = _learner(tiny_dense_path)
    raw = _groups(sampler, base, "c3po", 4, 8)
    live = [_rescored(raw[0], [1, 0] * 4), _rescored(raw[1], [0, 0, 1, 0, 0, 0, 0, 1])]
    dead = _rescored(raw[2], [0] * 8)
    filtered = _learner(tiny_dense_path, dynamic_filter=True)
    rf = _step(filtered, live + [dead])
    plain = _learner(tiny_dense_path)
    rp = _step(plain, live)
    assert rf.metrics["filtered_groups"] == 1 and rp.metrics["filtered_groups"] == 0
    assert rf.metrics["zero_adv_frac"] == pytest.approx(1 / 3)  # measured before filtering
    for n, t in _means(plain).items():  # a dead group adds nothing, not even to the loss denominator
        torch.testing.assert_close(_means(filtered)[n], t, rtol=0, atol=1e-7)
    idle = _learner(tiny_dense_path, dynamic_filter=True)
    before = _means(idle)
    r = _step(idle, [dead])
    assert r.metrics["filtered_groups"] == 1 and r.metrics["updates"] == 0 and r.step == 1
    assert all(torch.equal(t, before[n]) for n, t in _means(idle).items())


def test_lampo_compares_sequences_under_one_recomputed_policy(sampler, tiny_dense_path):
    a = _learner(tiny_dense_path, advantage="lampo")
    groups = _groups(sampler, a, "c3po", 4, 8)
    # the behaviour log-probs of slot 0 (one of N different policies) shifted: Δs must not see it
    shifted = [Group(g.group_id, g.item, g.policy_version, g.published_step, tuple(
        ScoredCompletion(dataclasses.replace(s.completion, logprobs=tuple(x - 3.0 for x in s.completion.logprobs)), s.result)
        if s.completion.slot == 0 else s for s in g.completions)) for g in groups]
    b = _learner(tiny_dense_path, advantage="lampo")
    ra, rb = _step(a, groups), _step(b, shifted)
    assert ra.metrics["advantage_mean"] == pytest.approx(rb.metrics["advantage_mean"], abs=1e-9)
    # ... and equal what the learner's forward at the step's gradient point gives
    c = _learner(tiny_dense_path, advantage="lampo")
    batch = collate(*batches_from_groups(groups))
    with torch.no_grad(), c.optimizer.ivon.sampled_params(update_seed(0, 0, 0, 0), train=False):
        logits = c.model(input_ids=batch.input_ids, attention_mask=batch.attn).logits[:, :-1]
    seq = adv_math.sequence_logprob(losses.token_logprobs(logits, batch.targets, 1.0), batch.mask, "sum")
    rewards = make_estimator(c.algo).rewards(batch)
    expected = adv_math.lampo_advantages(rewards, seq.view_as(rewards), tau=c.algo.lampo_tau)
    assert ra.metrics["advantage_mean"] == pytest.approx(float(expected.mean()), abs=1e-5)


def test_sync_budget_measures_drift_not_the_noise_between_slots(sampler, tiny_dense_path):
    # σ = 1/sqrt(λ(h0+δ)) ≈ 0.1: the slots differ a lot from θ̂′, but the mean has not moved yet
    learner = _learner(tiny_dense_path, optim=OptimConfig(ess=1e3), sync=SyncConfig(kappa=1e-3, eta=0.5, max_staleness=4))
    groups = _groups(sampler, learner, "c3po", 4, 8)
    first = _step(learner, groups)
    m = first.metrics
    assert m["kl_k3"] > 1e-2 and m["ess_frac"] < 0.9       # behaviour → gradient point: noise and drift
    assert m["kl_k3_drift"] < 1e-5 and m["ess_frac_drift"] > 0.999  # same slot rebuilt from today's mean
    assert not first.publish
    second = _step(learner, groups)  # the mean moved: now there is drift
    assert second.metrics["kl_k3_drift"] > m["kl_k3_drift"]


@pytest.mark.parametrize("modules", ["all", "mlp", "everything"])
def test_the_published_sigma_covers_the_noise_mask_alone_and_the_drift_is_rebuilt_with_it(
        sampler, tiny_dense_path, modules):
    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(ess=1e3),
                      SyncConfig(kappa=1e-3, eta=0.5, max_staleness=4), temperature=1.0, max_new_tokens=10,
                      noise=NoiseConfig(modules=modules))
    pv, ivon_sigma = learner.published(), learner.optimizer.ivon.sigma_by_name()
    noised = noised_names(list(pv.mean), modules)
    assert set(pv.sigma) == noised and 0 < len(noised) <= len(pv.mean)  # no zeros sent for the rest
    assert (modules == "everything") == (len(noised) == len(pv.mean))
    assert list(pv.sigma) == [n for n in pv.mean if n in noised]  # in the model's order
    for name, sigma in pv.sigma.items():
        assert np.array_equal(sigma, ivon_sigma[name].numpy()), name
    # rollouts sampled at the published (masked) slots are their own slots rebuilt: no drift yet
    first = _step(learner, _groups(sampler, learner, "c3po", 4, 8))
    assert first.metrics["kl_k3_drift"] < 1e-5 and first.metrics["ess_frac_drift"] > 0.999


def test_the_correction_reports_the_share_it_caps(sampler, tiny_dense_path):
    # σ ≈ 0.1: each rollout's slot is far from the update's gradient point θ̂′, so its weights are capped
    learner = _learner(tiny_dense_path, optim=OptimConfig(ess=1e3), is_correction="token_tis")
    noisy = _step(learner, _groups(sampler, learner, "c3po", 4, 8)).metrics
    assert 0.0 < noisy["is_clip_frac"] < 1.0
    grpo = _learner(tiny_dense_path, "none", 1, optim=OptimConfig(name="adamw"), is_correction="token_tis")
    assert _step(grpo, _groups(sampler, grpo, "none", 1, 8)).metrics["is_clip_frac"] == 0.0  # on-policy


def test_a_noise_mask_that_matches_no_parameter_is_refused(tiny_dense_path):
    with pytest.raises(ValueError, match="noise.layers"):
        Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(), SyncConfig(),
                temperature=1.0, max_new_tokens=10, noise=NoiseConfig(layers=(5, 9)))


def test_a_step_that_publishes_on_staleness_anyway_takes_no_drift_forward(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, sync=SyncConfig(max_staleness=2))
    groups = _groups(sampler, learner, "c3po", 4, 8)
    slot_forwards, original = [], learner._logprobs  # the start-of-step no-grad forwards (inline)

    def spy(batch, rows):
        slot_forwards.append(len(rows))
        return original(batch, rows)
    learner._logprobs = spy
    first = _step(learner, groups)  # the drift is measured (nothing fires: the mean barely moved)
    assert not first.publish and len(slot_forwards) == 1 and "kl_k3_drift" in first.metrics
    second = _step(learner, groups)  # steps_since_sync reaches max_staleness: it publishes regardless
    assert (second.publish, second.publish_reason) == (True, "staleness") and len(slot_forwards) == 1
    assert "kl_k3_drift" not in second.metrics and second.metrics["kl_k3"] > 0  # π_prox vs μ still reported
    third = _step(learner, groups)
    assert len(slot_forwards) == 2 and "kl_k3_drift" in third.metrics and not third.publish


def test_the_drift_of_a_scaled_slot_is_measured_against_the_slot_with_its_own_scale(sampler, tiny_dense_path):
    # dead-group-aware exploration serves θ̂ = m + 2 σ ⊙ z: rebuilt with c = 2 there is no drift yet;
    # rebuilt with c = 1 (a learner ignoring the scale) the noise difference would fire the sync budget
    def first_step(reported):
        learner = _learner(tiny_dense_path, optim=OptimConfig(ess=1e3), sync=SyncConfig(kappa=1e-3, max_staleness=4))
        return _step(learner, _groups(sampler, learner, "c3po", 4, 8, scale=2.0, reported_scale=reported))
    exact = first_step(None)
    assert exact.metrics["kl_k3_drift"] < 1e-5 and exact.metrics["ess_frac_drift"] > 0.999 and not exact.publish
    wrong = first_step(1.0)
    assert wrong.metrics["kl_k3_drift"] > 1e-3 and wrong.publish


@pytest.mark.parametrize("is_correction", ["none", "token_tis", "seq_tis", "seq_mis", "token_mis"])
def test_every_correction_takes_a_step(sampler, tiny_dense_path, is_correction):
    # seq_mis broadcast its keep mask to [B, B, T] before (the loss then failed its shape check)
    learner = _learner(tiny_dense_path, is_correction=is_correction)
    result = _step(learner, _groups(sampler, learner, "c3po", 4, 8))
    assert result.metrics["updates"] == 1 and math.isfinite(result.metrics["loss"])


def test_a_c3po_step_with_shared_prefixes_equals_the_plain_forwards(sampler, tiny_dense_path):
    # the update's whole groups and the drift diagnostic's one-slot rows (runs of 2 per group) both
    # take the shared-prefix forward; every figure and the new mean equal the plain forwards'
    plain, shared = (Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                             SyncConfig(max_staleness=2), temperature=1.0, max_new_tokens=10, shared_prefix=flag)
                     for flag in (False, True))
    groups = _groups(sampler, plain, "c3po", 4, 8)
    a, b = _step(plain, groups), _step(shared, groups)
    for key in ("loss", "kl_k3", "kl_k3_drift", "ess_frac_drift", "is_weight_mean"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-7), key
    assert a.metrics["kl_k3_drift"] > 0  # the drift diagnostic measured something
    for name, m in _means(plain).items():
        torch.testing.assert_close(_means(shared)[name], m, atol=1e-6, rtol=1e-5)


def test_the_drift_measured_in_a_process_beside_the_update_equals_the_drift_measured_inline(sampler, tiny_dense_path):
    # IVON on one CPU rank measures the drift in a process of its own (its model copy, m and σ through
    # shared memory) while the update's gradient is computed; it must give what the inline forward
    # gives, step after step, and the learner must not compute it itself
    apart = _learner(tiny_dense_path, sync=SyncConfig(max_staleness=8), drift_process=True)
    inline = _learner(tiny_dense_path, sync=SyncConfig(max_staleness=8))
    assert inline.drift_process is None and apart.drift_process.is_ready(wait_s=120)
    groups = _groups(sampler, apart, "c3po", 4, 8)
    forwards, original = [], apart._logprobs
    apart._logprobs = lambda batch, rows: forwards.append(len(rows)) or original(batch, rows)
    for _ in range(3):
        a, b = _step(apart, groups), _step(inline, groups)
        assert a.metrics["kl_k3_drift"] == pytest.approx(b.metrics["kl_k3_drift"], rel=1e-6, abs=1e-9)
        assert a.metrics["ess_frac_drift"] == pytest.approx(b.metrics["ess_frac_drift"], rel=1e-6)
        assert a.metrics["kl_k3_drift"] > 0 and a.publish == b.publish
    assert forwards == []  # every start-of-step forward of these steps ran in the process
    for name, p in apart.named:  # the updates themselves are the same
        assert torch.allclose(p, dict(inline.named)[name], atol=1e-7)
    process = apart.drift_process.proc
    apart.drift_process.close()
    assert process.wait(timeout=30) == 0  # it exits when its stdin closes


def test_an_error_in_the_process_beside_the_update_fails_the_step_and_the_next_one_runs(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, sync=SyncConfig(max_staleness=8), drift_process=True)
    assert learner.drift_process.is_ready(wait_s=120)
    groups = _groups(sampler, learner, "c3po", 4, 8)
    original = learner.drift_process.start

    def broken(batch, points, means, sigmas, run):  # runs that are no whole groups fail the forward there
        return original(batch, points, means, sigmas, lambda rows: len(rows) + 1)
    learner.drift_process.start = broken
    with pytest.raises(RuntimeError, match="failed in its process"):
        _step(learner, groups)
    learner.drift_process.start = original
    assert "kl_k3_drift" in _step(learner, groups).metrics  # the process still serves
    learner.drift_process.proc.kill()
    learner.drift_process.proc.wait()
    with pytest.raises(RuntimeError, match="process exited"):
        _step(learner, groups)


@pytest.mark.parametrize("optim,is_correction,entropy,budget", [("ivon", "seq_tis", 0.0, None),
                                                                  ("adamw", "seq_mis", 0.01, None),
                                                                  ("ivon", "seq_mis", 0.0, 150_000),
                                                                  ("ivon", "token_mis", 0.0, None)])
def test_a_step_in_micro_batches_equals_the_whole_update(sampler, tiny_dense_path, optim, is_correction, entropy,
                                                         budget):
    # activation_mb=1 holds one group of 8 rows of the tiny model: every update runs in micro-batches of
    # whole prompt runs (with `budget` bytes, of sub-runs of a group), with the whole update's
    # denominators (seq_mis: its mask from π_prox, computed first)
    exploration = "c3po" if optim == "ivon" else "none"
    algo = AlgoConfig(exploration=exploration, n_slots=4 if optim == "ivon" else 1, group_size=8,
                      is_correction=is_correction, entropy_coef=entropy)
    whole, split = (Learner(tiny_dense_path, algo, OptimConfig(name=optim, lr=1e-3 if optim == "adamw" else 10.0),
                            SyncConfig(max_staleness=2), temperature=1.0, max_new_tokens=10, activation_mb=mb)
                    for mb in ("off", 1))
    groups = _groups(sampler, whole, exploration, algo.n_slots, 8)
    batch = collate(*batches_from_groups(groups))
    rows = torch.arange(len(batch.statuses))
    split.budget = budget or split.budget
    parts = split._micro(batch, rows)
    assert len(parts) > 2 and len(whole._micro(batch, rows)) == 1
    assert all(len(p) < 8 for p in parts) if budget else all(len(p) % 8 == 0 for p in parts)
    for _ in range(2):
        a, b = _step(whole, groups), _step(split, groups)
        for key in ("loss", "clip_frac", "is_weight_mean", "kl_k3"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
    for (name, p), (_, q) in zip(whole.named, split.named):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(p, load_model(tiny_dense_path).state_dict()[n]) for n, p in whole.named)


def test_a_bf16_mixed_precision_step_keeps_fp32_state_and_agrees_with_fp32(sampler, tiny_dense_path):
    algo = AlgoConfig(exploration="c3po", n_slots=4, group_size=8)
    fp32, mixed = (Learner(tiny_dense_path, algo, OptimConfig(), SyncConfig(max_staleness=2), temperature=1.0,
                           max_new_tokens=10, bf16=flag) for flag in (False, True))
    groups = _groups(sampler, fp32, "c3po", 4, 8)
    a, b = _step(fp32, groups), _step(mixed, groups)
    # the sequence importance weights multiply ~10 token ratios, each off by bf16's rounding: the loss
    # moves, the update's direction does not
    assert b.metrics["kl_k3"] != a.metrics["kl_k3"]  # the matmuls really ran in bfloat16
    moved = [(_means(fp32)[n] - m0, _means(mixed)[n] - m0) for n, m0 in
             ((n, p.detach()) for n, p in load_model(tiny_dense_path).named_parameters())]
    assert all(m.dtype == torch.float32 for m in _means(mixed).values())
    cos = torch.nn.functional.cosine_similarity(torch.cat([x.flatten() for x, _ in moved]),
                                                torch.cat([y.flatten() for _, y in moved]), dim=0)
    assert cos > 0.99  # the same update, to bf16's precision (0.56 when autocast reused stale weight casts)


def _prompts(sampler, n=4):
    _, tokenizer = sampler
    return [tokenizer(i.prompt, add_special_tokens=False)["input_ids"] for i in generate_items("arith", "train", n, seed=1)]


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_noise_control_holds_the_slots_kl_at_its_target_within_a_few_versions(sampler, tiny_dense_path, calibrated):
    # on the tiny model σ as IVON initialises it (c = 1) gives a slot KL of ~0.005: the target needs c ≈ 2
    target = 0.015
    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                      SyncConfig(max_staleness=1), temperature=1.0, max_new_tokens=10,
                      noise=NoiseConfig(target_kl=target), noise_prompts=_prompts(sampler) if calibrated else None)
    first = learner.published("start")
    if calibrated:  # set on the training prompts before anything is served
        assert abs(math.log(learner.noise.latest["noise_kl"] / target)) < math.log(1.25)
        assert {c for _, c in first.slots} == {learner.noise.latest["noise_scale"]} and first.slots[0][1] > 1.5
    else:  # nothing to measure on yet: the server's own plan at c = 1
        assert first.slots is None
    kls, scales = [], []
    for _ in range(5):
        result = _step(learner, _groups(sampler, learner, "c3po", 4, 8))
        assert result.publish
        kls.append(result.metrics["noise_kl"])
        scales.append(result.metrics["noise_scale"])
        assert [c for _, c in learner.published().slots] == [scales[-1]] * 4  # what the version serves
    # measured on the step's rollouts: within 1.25x of the target from the first version (the tiny model:
    # 0.0156, 0.0146, 0.0142, 0.0145, 0.0149 for 0.015), while σ itself changes as IVON learns
    assert all(abs(math.log(kl / target)) < math.log(1.5) for kl in kls), kls
    assert scales[-1] > 1.5
    # the control's scale survives a checkpoint
    other = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                    SyncConfig(max_staleness=1), temperature=1.0, max_new_tokens=10, noise=NoiseConfig(target_kl=target))
    other.load_state(*learner.state())
    assert other.noise.scale == learner.noise.scale and other.noise.calibrated


def test_the_gate_redraws_a_slot_whose_kl_exceeds_it_and_serves_the_closest_draw(sampler, tiny_dense_path):
    from threepo.algorithms.exploration import noise_seed

    # a gate just above the target: draws vary around it, so some are over and get redrawn
    noise = NoiseConfig(target_kl=0.01, gate=1.05)
    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                      SyncConfig(max_staleness=1), temperature=1.0, max_new_tokens=10, noise=noise,
                      noise_prompts=_prompts(sampler))
    control = learner.noise
    control.calibrated, control.scale = True, 1.8  # slots around the target on this model (no calibration)
    mean = control.logits(learner.model)  # per chunk of probe rows
    draws = [[control._kl(learner.model, learner.optimizer, noise_seed(0, 0, i, d), mean) for d in range(4)]
             for i in range(4)]
    slots = control.plan(learner.model, learner.optimizer, step=0)
    bound, redraws = 1.05 * 0.01, 0
    for i, (seed, scale) in enumerate(slots):
        passing = [d for d, kl in enumerate(draws[i]) if kl <= bound]
        chosen = passing[0] if passing else min(range(4), key=lambda d: draws[i][d])
        assert seed == noise_seed(0, 0, i, chosen) and scale == 1.8
        redraws += passing[0] if passing else 3
    assert redraws == control.latest["noise_redraws"] > 0, draws
    assert control.latest["noise_kl"] == pytest.approx(statistics.median(d[0] for d in draws))  # of the first draws
    assert control.latest["noise_kl_served_max"] < max(d[0] for d in draws)  # the oversized first draw is not served


def test_low_rank_slot_noise_is_published_and_rebuilt_at_its_rank_while_training_samples_stay_full(sampler, tiny_dense_path):
    from threepo.algorithms.exploration import noise_seed
    from threepo.algorithms.param_noise import perturbed

    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                      SyncConfig(max_staleness=4, kappa=1.0, eta=1e-6), temperature=1.0, max_new_tokens=10,
                      noise=NoiseConfig(rank=1), noise_prompts=_prompts(sampler))
    pv = learner.published("start")
    assert pv.noise_rank == 1
    seed, scale = pv.slots[0]
    assert seed == noise_seed(0, 0, 0, 0)
    mean, sigma = learner.optimizer.served_posterior()
    name = next(n for n in learner.optimizer.noised if "mlp" in n)
    with learner.optimizer.at(seed, train=False, scale=scale, served=True):  # the slot the engines serve
        served = dict(learner.model.named_parameters())[name].detach().clone()
    assert torch.equal(served, perturbed(mean[name], sigma[name], seed, name, scale, rank=1))
    assert torch.linalg.matrix_rank(served - mean[name]).item() == 1
    with pytest.raises(ValueError, match="full-rank noise"):
        with learner.optimizer.ivon.sampled_params(seed, train=True, rank=1):
            pass
    # rollouts of the rank-1 slots are their own slots rebuilt: no drift; the step trains with full samples
    assert _step(learner, _groups(sampler, learner, "c3po", 4, 8)).metrics["kl_k3_drift"] < 1e-5


def test_a_diverged_policy_stops_the_learner_with_one_line_naming_the_learning_rate(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, "none", 1, optim=OptimConfig(name="adamw", lr=10.0))
    groups = _groups(sampler, learner, "none", 1, 8)
    with torch.no_grad():
        learner.named[0][1].fill_(float("nan"))  # what a step at a learning rate far too large leaves
    with pytest.raises(FloatingPointError, match=r"diverged .* optim.name=adamw, optim.lr=10: lower optim.lr"):
        _step(learner, groups)


def test_the_probe_takes_runs_of_rows_sharing_a_prompt_and_measures_what_a_plain_forward_does(sampler, tiny_dense_path,
                                                                                             monkeypatch):
    from threepo.services.model import prefix_forward
    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                      SyncConfig(max_staleness=1), temperature=1.0, max_new_tokens=10,
                      noise=NoiseConfig(target_kl=0.01, probe_rows=16))  # the learner's probe (vllm, sglang)
    groups = _groups(sampler, learner, "c3po", 4, 8)
    assert _step(learner, groups).publish
    control = learner.noise
    ids, attn, where, mask, run = control.probe
    # 3 groups of 8 rows: 16 probe rows -> 5 of each group, consecutive, one prompt per run
    assert run == 5 and len(ids) == 15
    batch = collate(*batches_from_groups(groups))
    for g in range(3):
        assert torch.equal(ids[5 * g:5 * g + 5], batch.input_ids[8 * g:8 * g + 5])
    assert [c.stop - c.start for c in control._chunks()] == [5, 5, 5]  # whole runs
    shared_calls, original = [], prefix_forward.shared_prefix_hidden
    monkeypatch.setattr(prefix_forward, "shared_prefix_hidden",
                        lambda *a, **k: shared_calls.append(a[3]) or original(*a, **k))
    shared = [control._kl(learner.model, learner.optimizer, seed, control.logits(learner.model)) for seed in (11, 12)]
    control.probe = (ids, attn, where, mask, 0)  # the same rows, each through a plain forward
    plain = [control._kl(learner.model, learner.optimizer, seed, control.logits(learner.model)) for seed in (11, 12)]
    assert shared == pytest.approx(plain, rel=1e-4) and shared[0] != shared[1]
    assert shared_calls == [5] * 12  # per seed the mean and the slot, 3 chunks each, every prompt once


def test_a_step_reports_its_time_by_phase_and_the_phases_add_up(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, sync=SyncConfig(max_staleness=4))
    groups = _groups(sampler, learner, "c3po", 4, 8)
    learner.clock.take()  # the first version's calibration and publish, before any step
    m = _step(learner, groups).metrics
    for phase in ("forward", "backward", "sample", "step", "drift", "other"):  # a C3PO step that measures drift
        assert m[f"time/{phase}_s"] > 0 and m[f"cpu/{phase}_s"] >= 0, phase
    within = sum(v for k, v in m.items() if k.startswith("time/"))
    assert within == pytest.approx(m["step_time_s"], rel=0.05)
    learner.published()
    assert set(learner.clock.take()) == {"time/publish_s", "cpu/publish_s"}


def test_the_drift_sample_takes_one_slots_rollouts_in_pairs_that_share_a_prompt():
    from threepo.services.learner.proximal import drift_sample

    points = [(seed, 1.0) for _ in range(8) for seed in (10, 10, 11, 11, 12, 12, 13, 13)]  # 8 groups of 8
    for step in range(4):
        rows = drift_sample(points, 8, step=step, seed=0, group_size=8)
        assert len(rows) == 8 and {points[r] for r in rows.tolist()} == {((10, 11, 12, 13)[step], 1.0)}
        groups = (rows // 8).tolist()
        assert all(groups.count(g) == 2 for g in groups)  # 4 prompts, both of the slot's rollouts of each
    assert not torch.equal(drift_sample(points, 8, step=0, seed=0, group_size=8),
                           drift_sample(points, 8, step=4, seed=0, group_size=8))  # groups drawn anew each step
    assert drift_sample(points, None, step=0, seed=0, group_size=8).tolist() == list(range(64))


def test_adamw_measures_the_drift_on_every_rollout_from_its_update_forward(sampler, tiny_dense_path):
    learner = _learner(tiny_dense_path, exploration="none", n_slots=1, optim=OptimConfig(name="adamw", lr=1e-4),
                       sync=SyncConfig(max_staleness=4, drift_rows=2))
    groups = _groups(sampler, learner, "none", 1, 8)
    forwards, original = [], learner._logprobs
    learner._logprobs = lambda batch, rows: forwards.append(len(rows)) or original(batch, rows)
    m = _step(learner, groups).metrics
    assert not forwards and m["kl_k3_drift"] == m["kl_k3"] and m["ess_frac_drift"] == m["ess_frac"]


@pytest.mark.parametrize("optim", ["ivon", "adamw"])
def test_a_step_reports_the_norm_of_the_gradient_it_stepped_with(sampler, tiny_dense_path, optim):
    exploration, n_slots = ("c3po", 4) if optim == "ivon" else ("none", 1)
    config = OptimConfig(name=optim)
    raw = _groups(sampler, _learner(tiny_dense_path, exploration, n_slots, optim=config), exploration, n_slots, 8)
    live = _step(_learner(tiny_dense_path, exploration, n_slots, optim=config), [_rescored(raw[0], [1, 0] * 4)])
    dead = _step(_learner(tiny_dense_path, exploration, n_slots, optim=config), [_rescored(raw[0], [0] * 8)])
    assert live.metrics["grad_norm"] > 0 and math.isfinite(live.metrics["grad_norm"])
    assert dead.metrics["grad_norm"] == 0.0  # every advantage 0: no gradient
