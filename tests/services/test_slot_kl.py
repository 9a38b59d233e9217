"""The noise control's measurement on the samplers (issue 38): each served slot's per-token KL to the
mean on its own rollouts (`HFEngine.slot_kl`), the KL gate in the sampler, and the learner's feedback
from those measurements holding the slots at the target."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from threepo.algorithms.exploration import make_plan, redraw_seed
from threepo.algorithms.noise_mask import NoiseConfig
from threepo.algorithms.noise_scale import feedback_scale, policy_kl
from threepo.algorithms.param_noise import perturbed_state
from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.learner.config import AlgoConfig
from threepo.services.learner.core import Learner
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.model.modeling import load_model
from threepo.services.model.tokenizer import build_tokenizer
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.sampling.sampler import KL_POSITIONS, Sampler
from threepo.services.tasks.prompting import PromptConfig, PromptEncoder
from threepo.services.tasks.synthetic import generate_items
from threepo.services.wire.batching import collate, score_batch
from threepo.services.wire.messages import (GroupRows, NoiseSpec, RolloutRequest, SamplingParams, VerifyResult,
                                            VerifyStatus)

PROMPTS = PromptEncoder(build_tokenizer(), PromptConfig())  # the tiny checkpoint's tokenizer: raw text
T = 0.9


def _version(engine, sigma=0.05, version=1):
    mean = {n: p.detach().float().numpy().copy() for n, p in engine._params.items()}
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    sigmas = {n: np.full(a.shape, sigma, dtype=np.float32) for n, a in mean.items() if ".layers." in n}
    engine.load_version(version, mean, sigmas, checksum)
    return mean, sigmas


def _rows(engine, noise, n_prompts=3, n=2, tokens=12):
    engine.serve(noise)
    prompts = [tuple(PROMPTS.encode(i.prompt)) for i in generate_items("arith", "train", n_prompts, seed=5)]
    out = engine.generate([EngineRequest(p, n, seed=11 + k) for k, p in enumerate(prompts)],
                          SamplingParams(temperature=T, max_new_tokens=tokens, stop_token_ids=PROMPTS.stop_ids))
    return [(p, s.token_ids) for p, samples in zip(prompts, out) for s in samples]


def _independent_kl(path, slot_weights, mean_weights, rows, positions):
    """Σ_t KL(slot ‖ mean) per row from transformers' fp32 forward of each whole row at the given weights."""
    def logits(weights):
        model = load_model(path).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name].float())
            out = []
            for prompt, completion in rows:
                n = min(len(completion), positions)
                ids = torch.tensor([list(prompt) + list(completion[:n])])
                out.append(model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n])
        return out
    return [float(policy_kl(a, b, T).sum()) for a, b in zip(logits(slot_weights), logits(mean_weights))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_slots_kl_is_measured_on_its_own_rollouts_as_an_independent_fp32_forward_finds_it(tiny_dense_path, dtype):
    engine = HFEngine(tiny_dense_path, SamplerConfig(dtype=dtype, batch_size=16))
    mean, sigma = _version(engine)
    slot = NoiseSpec(1, seed=77, scale=1.5)
    rows = _rows(engine, slot)
    engine.serve(slot)
    served_slot = {n: t.clone() for n, t in engine.served().items()}  # the weights as the engine holds them
    engine.serve(NoiseSpec(1, None))
    served_mean = {n: t.clone() for n, t in engine.served().items()}
    measured = engine.slot_kl(slot, rows, positions=8, temperature=T)
    want = _independent_kl(tiny_dense_path, served_slot, served_mean, rows, positions=8)
    assert [n for _, n in measured] == [min(len(c), 8) for _, c in rows]
    np.testing.assert_allclose([k for k, _ in measured], want, rtol=1e-3, atol=1e-6)
    assert min(want) > 0
    if dtype == "float32":  # the served fp32 slot is θ̂ = m + c · σ ⊙ z exactly: the KL the learner would compute
        theta = perturbed_state({n: torch.from_numpy(a) for n, a in mean.items()},
                                {n: torch.from_numpy(a) for n, a in sigma.items()}, 77, 1.5)
        exact = _independent_kl(tiny_dense_path, theta, {n: torch.from_numpy(a) for n, a in mean.items()}, rows, 8)
        np.testing.assert_allclose([k for k, _ in measured], exact, rtol=1e-3, atol=1e-6)
    assert engine.report.seed is None  # what was served is left as it was


def test_the_moe_model_without_a_lean_decoder_measures_through_transformers(tiny_moe_path):
    engine = HFEngine(tiny_moe_path, SamplerConfig(batch_size=16))
    assert not engine.lean
    mean, sigma = _version(engine)
    slot = NoiseSpec(1, seed=5)
    rows = _rows(engine, slot, n_prompts=2)
    engine.serve(slot)
    served_slot = {n: t.clone() for n, t in engine.served().items()}
    measured = engine.slot_kl(slot, rows, positions=KL_POSITIONS, temperature=T)
    assert engine.report.seed == 5 and engine.verify()  # the slot it served is served again
    engine.serve(NoiseSpec(1, None))
    want = _independent_kl(tiny_moe_path, served_slot, dict(engine.served()), rows, KL_POSITIONS)
    np.testing.assert_allclose([k for k, _ in measured], want, rtol=1e-3, atol=1e-6)


def test_an_adapter_slots_kl_is_measured_over_the_base_it_is_served_on(tiny_dense_path):
    from lora_learners import ivon_lora_learner

    from threepo.services.model.lora import LoRAConfig

    pv = ivon_lora_learner(tiny_dense_path, LoRAConfig(rank=4, alpha=8.0), nudge_seed=1).published()
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=16))
    engine.load_version(1, pv.mean, pv.sigma, pv.mean_checksum, pv.noise_rank, lora=pv.lora)
    slot = NoiseSpec(1, seed=9, scale=2.0)
    rows = _rows(engine, slot)
    engine.serve(slot)
    served_slot = {n: t.clone() for n, t in engine.served().items()}  # W0 + s · B̂ Â of the slot's sample
    engine.serve(NoiseSpec(1, None))
    want = _independent_kl(tiny_dense_path, served_slot, dict(engine.served()), rows, positions=8)
    measured = engine.slot_kl(slot, rows, positions=8, temperature=T)
    np.testing.assert_allclose([k for k, _ in measured], want, rtol=1e-3, atol=1e-6)
    assert min(want) > 0


class _ForgedKL:
    """A real engine whose `slot_kl` reports `huge` for the seeds in `broken` (a draw built to be far over
    the gate), and the real measurement otherwise; records each measured seed."""

    def __init__(self, inner, broken, huge=1.0):
        self.inner, self.broken, self.huge, self.measured, self.kl = inner, set(broken), huge, [], {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def slot_kl(self, noise, rows, positions, temperature):
        real = self.inner.slot_kl(noise, rows, positions, temperature)
        out = [(self.huge * n if noise.seed in self.broken else k, n) for k, n in real]
        self.measured.append((noise.seed, len(rows)))
        self.kl[noise.seed] = sum(k for k, _ in out) / sum(n for _, n in out)
        return out


def _requests(version, slot_seed, scale=1.0, n_prompts=3, n=2, first=0):
    items = generate_items("arith", "train", n_prompts + first, seed=2)[first:]
    return [RolloutRequest(f"{it.uid}/s0/{first}", it.uid, it, version, 0, slot_seed, n, slot_scale=scale) for it in items]


def _sampler(engine, probe_rows=4, gate=4.0, target=0.01, slots=((77, 1.0),)):
    cfg = SamplerConfig(max_new_tokens=8, temperature=T, seed=4)
    sampler = Sampler(engine, engine_id=0, cfg=cfg, prompts=PROMPTS,
                      noise=NoiseConfig(target_kl=target, gate=gate, probe_rows=probe_rows))
    mean = {n: p.detach().float().numpy().copy() for n, p in engine.inner._params.items()}
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    sigma = {n: np.full(a.shape, 0.02, dtype=np.float32) for n, a in mean.items() if ".layers." in n}
    sampler.update(1, mean, sigma, checksum, slots=slots)
    return sampler


def test_the_first_rollouts_of_each_slot_carry_its_measurement_and_later_ones_do_not(tiny_dense_path):
    # probe_rows = 1: one 64-token rollout's worth of positions; these completions are at most 8 tokens
    engine = _ForgedKL(HFEngine(tiny_dense_path, SamplerConfig(batch_size=16)), broken=())
    sampler = _sampler(engine, probe_rows=1)
    first = sampler.generate(_requests(1, 77))  # 3 prompts × 2 rollouts, ≤ 48 positions: all measured
    lengths = np.diff(first.token_offsets)
    assert engine.measured == [(77, 6)] and first.slot_kl_positions.tolist() == lengths.tolist()
    assert (first.slot_kl > 0).all() and first.slot_draw.tolist() == [0, 0, 0]
    second = sampler.generate(_requests(1, 77, first=3))  # measured until 64 positions in all
    held, wanted = int(lengths.sum()), 0
    for n in np.diff(second.token_offsets).tolist():
        wanted, held = wanted + (held < 64), held + n * (held < 64)
    assert engine.measured[-1] == (77, wanted) and 0 < wanted < 6
    assert (second.slot_kl_positions[:wanted] > 0).all() and not second.slot_kl_positions[wanted:].any()
    third = sampler.generate(_requests(1, 77, first=6))  # the version's quota for this slot is met
    assert len(engine.measured) == 2 and not third.slot_kl_positions.any()
    sampler.generate(_requests(1, 77, scale=2.0, first=9))  # a re-admitted scale is a slot of its own
    assert engine.measured[-1] == (77, 6)


def test_the_gate_redraws_a_slot_built_far_over_its_target_before_its_rollouts_go_anywhere(tiny_dense_path):
    engine = _ForgedKL(HFEngine(tiny_dense_path, SamplerConfig(batch_size=16)), broken={77})
    sampler = _sampler(engine)
    batch = sampler.generate(_requests(1, 77))
    redrawn = redraw_seed(77, 1)
    assert [seed for seed, _ in engine.measured] == [77, redrawn]  # the first redraw passes the gate
    assert {r.slot_seed for r in batch.requests} == {redrawn} and batch.slot_draw.tolist() == [1, 1, 1]
    assert sampler.stats()["noise_redraws"] == 1
    # the rollouts are those of the redraw: the engine, serving it, samples the same tokens
    engine.inner.serve(NoiseSpec(1, redrawn))
    again = engine.inner.generate(sampler._engine_requests(list(batch.requests)), sampler._params())
    assert [s.token_ids for per in again for s in per] == [
        tuple(batch.token_ids[batch.token_offsets[r]:batch.token_offsets[r + 1]]) for r in range(len(batch.texts))]
    later = sampler.generate(_requests(1, 77, first=3))  # later requests of the slot serve the redraw, not gated again
    assert {r.slot_seed for r in later.requests} == {redrawn} and later.slot_draw.tolist() == [1, 1, 1]
    assert engine.measured[-1][0] == redrawn and sampler.stats()["noise_redraws"] == 1
    # the learner rebuilds what was served from the batch: the redraw's seed
    groups = [GroupRows(r.group_id, r.item, 1, 0, ((0, 2 * i, 2),)) for i, r in enumerate(later.requests)]
    scores = score_batch([VerifyResult(VerifyStatus.WRONG, 0.0)] * 6, 0.0)
    assert set(collate(groups, [later], [scores]).slot_seeds) == {redrawn}


def test_a_slot_every_draw_of_which_is_over_the_gate_serves_the_closest(tiny_dense_path):
    # a target no draw can meet: three redraws, each measured, the one with the smallest KL kept
    engine = _ForgedKL(HFEngine(tiny_dense_path, SamplerConfig(batch_size=16)), broken=())
    sampler = _sampler(engine, target=1e-9)
    batch = sampler.generate(_requests(1, 77))
    seeds = [77] + [redraw_seed(77, d) for d in (1, 2, 3)]
    assert [s for s, _ in engine.measured] == seeds and sampler.stats()["noise_redraws"] == 3
    served = batch.requests[0].slot_seed
    assert served == min(seeds, key=engine.kl.get) and batch.slot_draw[0] == seeds.index(served)
    # no gate where the version did not publish the slot (the posterior server's own plan)
    plain = _sampler(_ForgedKL(engine.inner, broken={77}), target=1e-9, slots=())
    assert {r.slot_seed for r in plain.generate(_requests(1, 77)).requests} == {77}


def test_feedback_takes_half_the_median_implied_step_up_and_the_whole_step_down():
    # quadratic law k = a c²: each measurement implies c* = c sqrt(K / k); the median of them, half the way
    a, target = 0.004, 0.01
    measured = [(1.0, a), (2.0, 4 * a), (0.5, a / 4 * 9)]  # the last slot 9x heavier than the others
    c = feedback_scale(1.0, measured, target, gain=0.5)
    assert c == pytest.approx(math.sqrt(math.sqrt(target / a)))
    assert feedback_scale(1.3, [], target) == 1.3
    assert feedback_scale(1.0, [(1.0, 0.0)], target, max_factor=4.0) == pytest.approx(4.0)
    # over the target the whole step down, whatever the gain: 4x the target KL halves the scale
    assert feedback_scale(1.0, [(1.0, 4 * target)] * 3, target, gain=0.5) == pytest.approx(0.5)
    assert feedback_scale(1.0, [(1.0, 1e3 * target)], target, gain=0.5, max_factor=4.0) == pytest.approx(0.25)


@pytest.mark.parametrize("start", ["calibrated", "too_low"])
def test_the_learner_holds_the_served_slots_at_the_target_from_the_samplers_measurements(tiny_dense_path, start):
    """Closed loop through the run's own parts in one process: the learner publishes, a sampler serves
    the version's slots on the hf engine and measures them, the learner steps on those rollouts and sets
    the next scale from what they measured — no forward of its own at a slot. From the calibration the
    slots stay at the target; from a scale 4x too small (KL ~16x too small) they converge to it."""
    target, prompts = 0.015, [PROMPTS.encode(i.prompt) for i in generate_items("arith", "train", 16, seed=1)]
    learner = Learner(tiny_dense_path, AlgoConfig(exploration="c3po", n_slots=4, group_size=8), OptimConfig(),
                      SyncConfig(max_staleness=1), temperature=T, max_new_tokens=8,
                      noise=NoiseConfig(target_kl=target, probe_rows=4), noise_prompts=prompts,
                      samplers_measure_noise=True)
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=64))
    sampler = Sampler(engine, engine_id=0, cfg=SamplerConfig(max_new_tokens=8, temperature=T), prompts=PROMPTS,
                      noise=NoiseConfig(target_kl=target, probe_rows=4))
    forwards, original = [], learner.noise._kl
    learner.noise._kl = lambda *a: forwards.append(a) or original(*a)
    if start == "too_low":  # the tiny model needs c ≈ 1.8 for this target
        learner.noise.calibrated, learner.noise.scale = True, 0.45
    pv = learner.published("start")
    calibration = len(forwards)
    measured, scales = [], []
    for version in range(1, 9 if start == "too_low" else 7):
        sampler.update(version, pv.mean, pv.sigma, pv.mean_checksum, pv.noise_rank, slots=pv.slots)
        plan = make_plan("c3po", version=version, base_seed=0, group_size=8, n_slots=4).with_slots(pv.slots)
        items = generate_items("arith", "train", 4, seed=version)
        requests = [RolloutRequest(f"{it.uid}/s{s.index}", it.uid, it, version, s.index, s.seed, 2, slot_scale=s.scale)
                    for it in items for s in plan.slots]
        batch = sampler.generate(requests)
        kl = batch.slot_kl[batch.slot_kl_positions > 0].sum() / batch.slot_kl_positions.sum()
        measured.append(float(kl))
        groups = [GroupRows(it.uid, it, version, version - 1, tuple((0, 8 * g + 2 * s, 2) for s in range(4)))
                  for g, it in enumerate(items)]
        rewards = np.random.default_rng(version).random(len(batch.texts)) < 0.5
        scores = score_batch([VerifyResult(VerifyStatus.OK if r else VerifyStatus.WRONG, float(r)) for r in rewards], 0.0)
        result = learner.step(groups, [batch], [scores])
        assert result.publish and result.metrics["noise_kl"] == pytest.approx(np.median(
            [batch.slot_kl[[r for r in range(len(batch.texts)) if batch.requests[batch.row_request[r]].slot == s
                            and batch.slot_kl_positions[r]]].sum()
             / batch.slot_kl_positions[[r for r in range(len(batch.texts))
                                        if batch.requests[batch.row_request[r]].slot == s]].sum() for s in range(4)]))
        scales.append(result.metrics["noise_scale"])
        pv = learner.published()
    assert len(forwards) == calibration  # after the calibration the learner measured nothing itself
    if start == "calibrated":  # the tiny model: 0.0119, 0.0156, 0.0138, 0.0146, 0.0143, 0.0151
        assert all(abs(math.log(k / target)) < math.log(1.5) for k in measured), measured
    else:  # 0.0008 at c = 0.45; up by half the quadratic law's step (at most 2x) per version
        assert measured[0] < target / 8 and scales[0] == pytest.approx(2 * 0.45), (measured, scales)
        assert scales[:3] == sorted(scales[:3]), scales
    assert all(abs(math.log(k / target)) < math.log(1.3) for k in measured[-2:]), measured
    assert scales[-1] == pv.slots[0][1]


def test_the_scale_follows_the_newest_version_measured_and_ignores_older_ones():
    from types import SimpleNamespace

    from threepo.services.learner.noise_control import NoiseControl

    def batch(version, kls, scale=1.0, redrawn=0):  # one row per group, each row a slot measured on 50 positions
        n = len(kls)
        return SimpleNamespace(rewards=np.zeros((n, 1)), published_steps=np.full(n, version),
                               slot_seeds=[100 * version + i for i in range(n)], slot_scales=[scale] * n,
                               slot_kl=np.array(kls) * 50, slot_kl_positions=np.full(n, 50),
                               slot_draws=np.array([redrawn] * n))

    control = NoiseControl(NoiseConfig(target_kl=0.01), n_slots=2, base_seed=0, temperature=1.0,
                           measured_by_samplers=True)
    control.calibrated = True
    control.observe(batch(1, [0.0025, 0.0025]))  # an older version, slots 4x under the target
    control.observe(batch(3, [0.04, 0.04, 0.09], redrawn=1))  # the newest: 4x over (one slot 9x)
    slots = control.plan(None, None, step=5)
    assert control.scale == pytest.approx(0.5) and [c for _, c in slots] == [control.scale] * 2
    assert control.latest == {"noise_kl": pytest.approx(0.04), "noise_kl_served_max": pytest.approx(0.09),
                              "noise_redraws": 3.0, "noise_scale": pytest.approx(0.5)}
    control.observe(batch(1, [0.0025]))  # arrives after version 3 set the scale: older, not used
    control.plan(None, None, step=6)
    assert control.scale == pytest.approx(0.5) and control.latest["noise_kl"] == pytest.approx(0.04)
    control.observe(batch(3, [0.0025], scale=0.5))  # more of version 3 (another sampler's, re-admitted at 0.5): used
    control.plan(None, None, step=7)
    assert control.scale == pytest.approx(0.5 * math.sqrt(2.0))  # up: half of log(sqrt(0.01 / 0.0025)) = log 2
