"""The engine conformance suite: every backend (hf, vllm, sglang) must pass all of it.

The reference is the learner itself: its model, its IVON posterior, and θ̂ built by IVON's own
`sampled_params(seed)` (which is how the learner takes a gradient at a slot's sample). An engine
serves the (m, σ) the learner publishes and must report behaviour log-probs equal to the learner's
forward of the same tokens under the same sampling distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threepo.algorithms.ivon import IVON
from threepo.algorithms.noise_mask import MaskedSigma, noised_names
from threepo.algorithms.sampling import sampling_logprobs
from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters
from threepo.services.model.tokenizer import build_tokenizer
from threepo.services.sampling.engines.base import EngineRequest, WeightsMismatch
from threepo.services.tasks.prompting import PromptConfig, PromptEncoder
from threepo.services.wire.messages import NoiseSpec, SamplingParams

FILTERS = {"T=1": dict(temperature=1.0), "T=0.7,k=5,p=0.8": dict(temperature=0.7, top_k=5, top_p=0.8)}
PROMPTS = ("Q: 12+34= A: ", "Q: 7*8= A: ", "x")
ENCODER = PromptEncoder(build_tokenizer(), PromptConfig())  # the tiny checkpoint's: raw text, no template


class Learner:
    """The learner's side: model, tokenizer and an IVON posterior with σ ≈ `sigma`."""

    def __init__(self, path: str, sigma: float = 0.03, mean_shift: float = 0.0):
        self.model = load_model(path).eval()
        if mean_shift:  # a later version: a different mean
            with torch.no_grad():
                for _, p in trainable_named_parameters(self.model):
                    p.add_(mean_shift * torch.sign(p))
        self.tokenizer = load_tokenizer(path)
        hess = 0.1
        self.opt = IVON(trainable_named_parameters(self.model), lr=1.0, ess=1.0 / (sigma ** 2 * hess),
                        hess_init=hess, weight_decay=0.0)

    def published(self):
        mean = {n: t.numpy().copy() for n, t in self.opt.mean_by_name().items()}
        sigma = {n: t.numpy().copy() for n, t in self.opt.sigma_by_name().items()}
        return mean, sigma, weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())

    @torch.no_grad()
    def logprobs(self, prompt_ids, token_ids, seed, scale=1.0, sigma=None, rank=0, **filters) -> np.ndarray:
        ids = torch.tensor([list(prompt_ids) + list(token_ids)])
        with self.opt.sampled_params(seed, train=False, scale=scale, sigma=sigma, rank=rank):
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
        logp = sampling_logprobs(logits, temperature=filters.get("temperature", 1.0),
                                 top_k=filters.get("top_k", 0), top_p=filters.get("top_p", 1.0))
        return logp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).numpy()


@pytest.fixture(scope="module")
def learner(tiny_dense_path):
    return Learner(tiny_dense_path)


@pytest.fixture
def served(engine, learner):
    """The engine holding version 1 of the learner's posterior, serving the mean."""
    backend, eng = engine
    eng.load_version(1, *learner.published())
    return backend, eng


def _requests(eng, seeds=(11, 22, 33), n=2):
    return [EngineRequest(ENCODER.encode(p), n, seed) for p, seed in zip(PROMPTS, seeds)]


def _params(**filters):
    return SamplingParams(max_new_tokens=12, **{"temperature": 1.0, **filters})


def _truncating(backend: str, eng, filters: dict) -> bool:
    """SGLang (0.5.23) reports log-probs before top-k/top-p truncation, so its adapter samples at a
    temperature only and refuses truncating filters in one clear error: check that, and say so."""
    if not backend.startswith("sglang") or not (filters.get("top_k") or filters.get("top_p", 1.0) < 1):
        return False
    with pytest.raises(ValueError, match="before top-k/top-p truncation"):
        eng.generate(_requests(eng), _params(**filters))
    return True


def _assert_matches_learner(learner, requests, outputs, seed, filters, scale=1.0, sigma=None, rank=0):
    checked = 0
    for r, samples in zip(requests, outputs):
        assert len(samples) == r.n
        for s in samples:
            expected = learner.logprobs(r.prompt_ids, s.token_ids, seed, scale, sigma, rank, **filters)
            np.testing.assert_allclose(s.logprobs, expected, atol=1e-4)
            checked += len(s.token_ids)
    assert checked > 0


@pytest.mark.parametrize("filters", FILTERS.values(), ids=FILTERS.keys())
def test_behaviour_logprobs_equal_the_learner_forward_at_the_mean(served, learner, filters):
    backend, eng = served
    if _truncating(backend, eng, filters):
        return
    requests = _requests(eng)
    _assert_matches_learner(learner, requests, eng.generate(requests, _params(**filters)), None, filters)


@pytest.mark.parametrize("filters", FILTERS.values(), ids=FILTERS.keys())
def test_a_slot_samples_from_theta_as_the_learner_builds_it(served, learner, filters):
    backend, eng = served
    if _truncating(backend, eng, filters):
        return
    report = eng.serve(NoiseSpec(1, 2026))
    assert report.loaded_ok and (report.version, report.seed) == (1, 2026)
    assert report.mean_checksum == learner.published()[2]
    requests = _requests(eng)
    outputs = eng.generate(requests, _params(**filters))
    _assert_matches_learner(learner, requests, outputs, 2026, filters)
    with pytest.raises(AssertionError):  # and not from the mean: the noise really is served
        _assert_matches_learner(learner, requests, outputs, None, filters)


@pytest.mark.parametrize("filters", FILTERS.values(), ids=FILTERS.keys())
def test_a_scaled_slot_samples_from_m_plus_c_sigma_z_as_the_learner_rebuilds_it(served, learner, filters):
    # dead-group-aware exploration: the same seed with σ × 2.5; behaviour log-probs are the scaled policy's
    backend, eng = served
    if _truncating(backend, eng, filters):
        return
    report = eng.serve(NoiseSpec(1, 2026, scale=2.5))
    assert report.loaded_ok and (report.version, report.seed, report.scale) == (1, 2026, 2.5)
    requests = _requests(eng)
    outputs = eng.generate(requests, _params(**filters))
    _assert_matches_learner(learner, requests, outputs, 2026, filters, scale=2.5)
    with pytest.raises(AssertionError):  # not the unscaled slot: the multiplier really is served
        _assert_matches_learner(learner, requests, outputs, 2026, filters)
    eng.serve(NoiseSpec(1, 2026))  # and back to c = 1 for the same seed: no state of the scaled slot left
    again = eng.generate(requests, _params(**filters))
    _assert_matches_learner(learner, requests, again, 2026, filters)


def test_a_slot_under_a_noise_mask_is_exactly_the_mean_outside_it(served, learner):
    """noise.modules=mlp: the learner publishes σ = 0 outside the MLP weights. The engine's slot is the
    learner's θ̂ built with that σ (the mean outside the mask), not the unmasked θ̂ and not the mean."""
    backend, eng = served
    noised = noised_names(list(learner.opt.mean_by_name()), "mlp")
    mean, sigma, checksum = learner.published()
    eng.load_version(2, mean, {n: s if n in noised else np.zeros_like(s) for n, s in sigma.items()}, checksum)
    assert eng.serve(NoiseSpec(2, 2026)).loaded_ok
    if backend == "hf":  # its served weights can be read by name: m exactly on every masked tensor
        served_now = eng.served()
        assert all(torch.equal(served_now[n].float(), torch.from_numpy(m)) for n, m in mean.items() if n not in noised)
        assert all(not torch.equal(served_now[n].float(), torch.from_numpy(mean[n])) for n in noised)
    requests = _requests(eng)
    outputs = eng.generate(requests, _params())
    _assert_matches_learner(learner, requests, outputs, 2026, {}, sigma=MaskedSigma(learner.opt.sigma_by_name(), noised))
    with pytest.raises(AssertionError):  # the unmasked slot is another policy: the mask is what is served
        _assert_matches_learner(learner, requests, outputs, 2026, {})
    with pytest.raises(AssertionError):  # and the MLP noise is there: not the mean
        _assert_matches_learner(learner, requests, outputs, None, {})


def test_a_version_with_low_rank_noise_serves_the_learners_low_rank_slot(served, learner):
    """noise.rank=2: every slot of the version draws z of rank 2 per matrix; the engine's slot is the
    learner's rank-2 θ̂ (rebuilt as the learner's drift and noise control do), not the full-noise one."""
    backend, eng = served
    mean, sigma, checksum = learner.published()
    eng.load_version(3, mean, sigma, checksum, 2)  # noise_rank (positional: the vLLM engine is remote)
    assert eng.serve(NoiseSpec(3, 2026, scale=4.0)).loaded_ok  # c = 4: the two slots differ visibly
    if backend == "hf":  # each served matrix's noise is of rank 2, the vectors' noise full
        served_now = eng.served()
        for name, m in mean.items():
            delta = served_now[name].float() - torch.from_numpy(m)
            assert torch.linalg.matrix_rank(delta).item() == 2 if delta.ndim == 2 else bool((delta != 0).all()), name
    requests = _requests(eng)
    outputs = eng.generate(requests, _params())
    _assert_matches_learner(learner, requests, outputs, 2026, {}, scale=4.0, rank=2)
    with pytest.raises(AssertionError):
        _assert_matches_learner(learner, requests, outputs, 2026, {}, scale=4.0)


def test_the_same_version_slot_and_request_seed_reproduce_the_completion(served):
    _, eng = served
    eng.serve(NoiseSpec(1, 7))
    params = _params(temperature=1.0)
    alone = eng.generate(_requests(eng)[1:2], params)[0]
    crowd = eng.generate(_requests(eng, seeds=(5, 22, 99)), params)[1]  # same request, other neighbours
    eng.serve(NoiseSpec(1, 8))
    eng.serve(NoiseSpec(1, 7))
    again = eng.generate(_requests(eng)[1:2], params)[0]
    assert [s.token_ids for s in alone] == [s.token_ids for s in crowd] == [s.token_ids for s in again]
    assert len({s.token_ids for s in alone}) == 2  # sample j of a request draws from seed + j
    other = eng.generate(_requests(eng, seeds=(0, 23, 0)), params)[1]
    assert [s.token_ids for s in other] != [s.token_ids for s in alone]


def test_serving_the_mean_after_a_slot_restores_it_bit_exactly(served):
    _, eng = served
    requests = _requests(eng)
    before = eng.generate(requests, _params())
    eng.serve(NoiseSpec(1, 31337))
    eng.generate(requests, _params())
    report = eng.serve(NoiseSpec(1, None))
    after = eng.generate(requests, _params())
    assert report.loaded_ok and report.noise_ratio == 1.0
    assert [[(s.token_ids, s.logprobs) for s in g] for g in after] == \
        [[(s.token_ids, s.logprobs) for s in g] for g in before]


def test_a_version_update_reloads_in_place_without_restarting_the_engine(served, tiny_dense_path):
    _, eng = served
    started = eng.identity()
    later = Learner(tiny_dense_path, mean_shift=0.01)
    eng.load_version(2, *later.published())
    eng.serve(NoiseSpec(2, 5))
    assert eng.identity() == started
    requests = _requests(eng)
    _assert_matches_learner(later, requests, eng.generate(requests, _params()), 5, {})


def test_no_kv_state_computed_under_other_weights_is_reused(served, learner, tiny_dense_path):
    # prompts longer than a cache block (vLLM's CPU block is 128 tokens): a reused prefix would give
    # log-probs of the other policy
    _, eng = served
    long = [EngineRequest(ENCODER.encode("Q: " + "12+34+56+78+" * 16 + "9= A: "), 2, 40 + i) for i in range(2)]
    assert len(long[0].prompt_ids) > 128
    params = _params()
    eng.serve(NoiseSpec(1, 100))
    eng.generate(long, params)
    eng.serve(NoiseSpec(1, 200))
    _assert_matches_learner(learner, long, eng.generate(long, params), 200, {})
    later = Learner(tiny_dense_path, mean_shift=0.01)  # same seed, next version: other weights again
    eng.load_version(2, *later.published())
    eng.serve(NoiseSpec(2, 200))
    _assert_matches_learner(later, long, eng.generate(long, params), 200, {})


def test_finish_reasons_eos_and_length(served):
    # the untrained model samples EOS (id 1) with probability ~1/72 per step: over 48 x 40 steps both occur
    _, eng = served
    samples = eng.generate([EngineRequest(ENCODER.encode("Q: 1+1= A: "), 48, 5)],
                           SamplingParams(max_new_tokens=40))[0]
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == 1 and 1 not in s.token_ids[:-1]
        else:
            assert len(s.token_ids) == 40 and 1 not in s.token_ids


def test_a_mean_that_is_not_the_published_one_is_refused(served, learner):
    _, eng = served
    mean, sigma, checksum = learner.published()
    broken = dict(mean)
    name = sorted(broken)[0]
    broken[name] = broken[name].copy()
    broken[name].flat[0] += 1e-3  # one element corrupted in transit
    with pytest.raises(WeightsMismatch, match="checksum"):
        eng.load_version(3, broken, sigma, checksum)
    assert eng.serve(NoiseSpec(1, 9)).loaded_ok  # still serving version 1


def test_weights_corrupted_while_serving_are_detected(served):
    backend, eng = served
    eng.serve(NoiseSpec(1, 77))
    assert eng.verify()
    if backend == "hf":
        with torch.no_grad():
            next(iter(eng.served().values())).view(-1)[0] *= 1.5
    elif backend == "vllm":
        eng.corrupt(1.5)
    elif backend == "sglang_fake":
        with torch.no_grad():
            next(eng.engine.model.parameters()).view(-1)[0] *= 1.5
    else:
        pytest.skip("fault injection into SGLang workers is not wired")
    assert not eng.verify()
    assert eng.serve(NoiseSpec(1, 77)).loaded_ok and eng.verify()  # a fresh load heals it


def test_served_noise_is_all_there_in_fp32(served):
    _, eng = served
    assert eng.serve(NoiseSpec(1, 3)).noise_ratio == pytest.approx(1.0, abs=1e-6)


def test_a_version_staged_as_a_file_serves_as_the_arrays_do(served, learner, tmp_path):
    """vLLM with workers in other processes (tensor_parallel_size > 1) gets (m, σ) as a staged file
    by path: the worker side of that path, on the real engine."""
    from threepo.services.sampling.engines.staging import stage_version

    backend, eng = served
    if backend != "vllm":
        pytest.skip("the staged path is the vLLM engine's")
    mean, sigma, checksum = learner.published()
    path = stage_version(mean, sigma, str(tmp_path), "staged")
    assert eng.rpc("threepo_load_version", 1, path, None, checksum) == [checksum]
    assert eng.rpc("threepo_held_bytes")[0]["device"] == 0
    assert eng.serve(NoiseSpec(1, 2026)).loaded_ok
    requests = _requests(eng)
    _assert_matches_learner(learner, requests, eng.generate(requests, _params()), 2026, {})
