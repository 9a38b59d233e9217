"""The HF sampler engine: tokenizer round trip, exact behaviour log-probs, parameter noise, restore."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from threepo.algorithms import param_noise
from threepo.algorithms.sampling import sampling_logprobs
from threepo.services.engines.base import SamplerConfig
from threepo.services.engines.hf import HFEngine
from threepo.services.messages import NoiseSpec, SamplingParams
from threepo.services.tasks import CHARSET


def test_tokenizer_round_trips_through_autotokenizer(tiny_dense_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_path)
    text = "Q: 23+58= A: \\boxed{81} " + CHARSET
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character, spaces included
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1


@pytest.fixture(scope="module")
def engine(tiny_dense_path):
    return HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.8, 1.3)])
def test_behaviour_logprobs_match_a_separate_forward_pass(engine, top_k, top_p, temperature):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, n=3)
    prompts = ["Q: 1+2= A: ", "Q: 23*58= A: ", "x"]  # different lengths exercise left padding
    for prompt, samples in zip(prompts, engine.generate(prompts, params)):
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.token_ids)])
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
            logp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
            expected = logp.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            np.testing.assert_allclose(s.logprobs, expected.numpy(), atol=1e-4)
            assert s.finish_reason == ("stop" if s.token_ids[-1] == 1 else "length")
            assert len(s.token_ids) == len(s.logprobs) <= 12


def test_generation_stops_at_eos_and_reports_finish_reasons(engine):
    # an untrained model samples EOS with probability ~1/72 per step: over 64 x 64 steps both
    # outcomes occur, and no row may continue past its EOS
    samples = engine.generate(["Q: 1+1= A: "], SamplingParams(max_new_tokens=64, n=64))[0]
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    for s in samples:
        assert (1 in s.token_ids) == (s.finish_reason == "stop")
        if s.finish_reason == "stop":
            assert s.token_ids.index(1) == len(s.token_ids) - 1
        else:
            assert len(s.token_ids) == 64


def _sigma(engine, scale=0.02):
    return {n: np.full(p.shape, scale, dtype=np.float32) for n, p in engine._params.items()}


def test_perturbation_differs_across_seeds_and_restore_is_bit_exact(engine):
    mean = {n: p.detach().numpy().copy() for n, p in engine._params.items()}
    engine.update_posterior(1, mean, _sigma(engine))
    clean = engine.checksum
    a = engine.serve(NoiseSpec(1, seed=11))
    weights_a = {n: p.detach().clone() for n, p in engine._params.items()}
    b = engine.serve(NoiseSpec(1, seed=12))
    assert len({clean, a, b}) == 3
    delta = weights_a["model.embed_tokens.weight"] - torch.from_numpy(mean["model.embed_tokens.weight"])
    assert 0.015 < float(delta.std()) < 0.025  # σ = 0.02 of unit-normal noise
    assert engine.serve(NoiseSpec(1, seed=11)) == a  # same seed, same weights
    assert engine.serve(NoiseSpec(1, seed=None)) == clean
    for n, p in engine._params.items():  # the mean comes back bit for bit
        assert torch.equal(p.detach(), torch.from_numpy(mean[n])), n
    with pytest.raises(ValueError, match="version"):
        engine.serve(NoiseSpec(2, seed=1))


def test_perturbation_is_identical_in_another_process(engine, tiny_dense_path):
    mean = {n: p.detach().numpy().copy() for n, p in engine._params.items()}
    engine.update_posterior(3, mean, _sigma(engine))
    here = engine.serve(NoiseSpec(3, seed=2026))
    code = f"""
import numpy as np
from threepo.services.engines.base import SamplerConfig
from threepo.services.engines.hf import HFEngine
from threepo.services.messages import NoiseSpec
e = HFEngine({tiny_dense_path!r}, SamplerConfig(threads=2))
mean = {{n: p.detach().numpy().copy() for n, p in e._params.items()}}
e.update_posterior(3, mean, {{n: np.full(p.shape, 0.02, dtype=np.float32) for n, p in e._params.items()}})
print(e.serve(NoiseSpec(3, seed=2026)), e.serve(NoiseSpec(3, seed=2027)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    there_same, there_other = out.stdout.split()
    assert there_same == here and there_other != here


def test_checksum_is_order_and_thread_independent():
    gen = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(1000, generator=gen)), ("b", torch.randn(7, 3, generator=gen))]
    assert param_noise.weights_checksum(named) == param_noise.weights_checksum(named[::-1])
    flipped = [("a", named[0][1].flip(0)), named[1]]  # a permutation changes it
    assert param_noise.weights_checksum(flipped) != param_noise.weights_checksum(named)
    nudged = [("a", named[0][1].clone()), named[1]]
    nudged[0][1][500] = torch.nextafter(nudged[0][1][500], torch.tensor(10.0))  # one ulp
    assert param_noise.weights_checksum(nudged) != param_noise.weights_checksum(named)
