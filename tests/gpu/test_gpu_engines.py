"""The GPU tier's engine part: vLLM and SGLang on a CUDA device, in this process (no Ray), where their
packages import. Each engine takes a version of (m, σ), serves a slot and samples from it; the slot's
behaviour log-probs equal a forward of the learner's θ̂ for that seed (fp32 served, 1e-3: GPU
kernels), a seeded request reproduces, and a mean with the wrong checksum is refused. Skipped with the
reason where the package or CUDA is missing, and in the dry run (the engines need a GPU)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from threepo.algorithms.param_noise import perturbed_state
from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.model.modeling import load_model, trainable_named_parameters
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig, WeightsMismatch
from threepo.services.wire.messages import NoiseSpec, SamplingParams

TARGET = os.environ.get("THREEPO_GPU_TIER_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TARGET != "cuda" or not torch.cuda.is_available(),
                                                  reason="the GPU engines need a CUDA device")]


def _engine(backend: str, path: str):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here")
    cfg = SamplerConfig(backend=backend, batch_size=16, seed=0, max_new_tokens=8, gpu_memory_utilization=0.3)
    if backend == "vllm":
        from threepo.services.sampling.engines.vllm_engine import VLLMEngine

        return VLLMEngine(path, cfg, dtype="float32")
    from threepo.services.sampling.engines.sglang_engine import SGLangEngine

    return SGLangEngine(path, cfg, dtype="float32")


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_gpu_engine_serves_the_learners_theta_and_refuses_a_wrong_mean(backend, tiny_dense_path):
    engine = _engine(backend, tiny_dense_path)
    try:
        model = load_model(tiny_dense_path).eval()
        mean = {n: p.detach().numpy().copy() for n, p in trainable_named_parameters(model)}
        sigma = {n: np.full(a.shape, 0.02, dtype=np.float32) for n, a in mean.items()}
        checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
        with pytest.raises(WeightsMismatch):
            engine.load_version(1, mean, sigma, "0" * 16)
        engine.load_version(1, mean, sigma, checksum)
        assert engine.serve(NoiseSpec(1, seed=2026)).loaded_ok and engine.verify()
        request = [EngineRequest((5, 6, 7), 2, seed=11)]
        params = SamplingParams(max_new_tokens=8)
        first, again = engine.generate(request, params), engine.generate(request, params)
        assert [s.token_ids for s in first[0]] == [s.token_ids for s in again[0]]
        theta = perturbed_state({n: torch.from_numpy(a) for n, a in mean.items()},
                                {n: torch.from_numpy(a) for n, a in sigma.items()}, 2026)
        with torch.no_grad():
            for name, p in trainable_named_parameters(model):
                p.copy_(theta[name])
            for s in first[0]:
                ids = torch.tensor([[5, 6, 7, *s.token_ids]])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, 2:-1].float(), -1)
                expected = logp.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1).numpy()
                np.testing.assert_allclose(s.logprobs, expected, atol=1e-3)
    finally:
        engine.close()
