"""The GPU tier (`pytest -m gpu`): what runs on a CUDA device, against the same work on the CPU.
Needs only torch, transformers, safetensors, numpy and msgpack (no Ray, no vLLM): it runs on a bare
CUDA machine, and `benchmarks/gpu_check.py` runs it there. Skipped without CUDA. `THREEPO_GPU_TIER_DEVICE=cpu`
runs the same bodies with the CPU as the target device (gpu_check.py --dry-run: the code paths and
the tests themselves, not the GPU).

Tolerances: noise, θ̂, its bf16 cast, checksums and fingerprints are bit-identical across devices
(integer arithmetic and single correctly rounded fp32 operations); a learner step's update of the
mean agrees to 1e-3 relative (fp32 matmuls sum in another order on a GPU, TF32 off); the engine's
served slot is bit-identical and its first-token log-probs agree to 1e-3."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from threepo.algorithms import counter_normal, param_noise, weight_checks
from threepo.services.learner.config import AlgoConfig
from threepo.services.learner.core import Learner
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.wire.messages import NoiseSpec, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from workload import sampled_groups, step  # noqa: E402

TARGET = os.environ.get("THREEPO_GPU_TIER_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TARGET == "cuda" and not torch.cuda.is_available(),
                                                  reason="no CUDA device (set THREEPO_GPU_TIER_DEVICE=cpu to dry-run)")]


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_noise_theta_and_checks_are_bit_identical_on_the_device():
    param_noise.check_noise_device(torch.device(TARGET))  # the device reproduces NOISE_SIGNATURE
    key, n = param_noise.tensor_seed(5, "model.layers.0.mlp.up_proj.weight"), 3_000_001
    assert torch.equal(counter_normal.standard_normal(key, n, device=TARGET).cpu(), counter_normal.standard_normal(key, n))
    index = torch.tensor([0, 17, n - 1])
    assert torch.equal(counter_normal.standard_normal_at(key, index.to(TARGET)).cpu(), counter_normal.standard_normal_at(key, index))
    gen = torch.Generator().manual_seed(0)
    mean, sigma = torch.randn(1000, 300, generator=gen), torch.rand(1000, 300, generator=gen) * 1e-3
    here = param_noise.perturbed(mean, sigma, 9, "w", 1.5)
    there = param_noise.perturbed(mean.to(TARGET), sigma.to(TARGET), 9, "w", 1.5)
    assert torch.equal(there.cpu().view(torch.int32), here.view(torch.int32))
    assert torch.equal(there.bfloat16().cpu().view(torch.int16), here.bfloat16().view(torch.int16))  # bf16 round trip
    assert weight_checks.weights_checksum([("w", there)]) == weight_checks.weights_checksum([("w", here)])
    assert weight_checks.value_fingerprint([there.bfloat16()]) == weight_checks.value_fingerprint([here.bfloat16()])


def _learner(path: str, exploration: str, device: str) -> Learner:
    optim = OptimConfig() if exploration == "c3po" else OptimConfig(name="adamw", lr=1e-4)
    return Learner(path, AlgoConfig(exploration=exploration, n_slots=4 if exploration == "c3po" else 1, group_size=8),
                   optim, SyncConfig(max_staleness=2), temperature=1.0, max_new_tokens=8, device=device)


@pytest.mark.parametrize("exploration", ["c3po", "none"])
def test_a_learner_step_on_the_device_equals_the_cpu_step(tiny_dense_path, exploration):
    cpu, dev = _learner(tiny_dense_path, exploration, "cpu"), _learner(tiny_dense_path, exploration, TARGET)
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=64, seed=1))
    groups = sampled_groups(engine, cpu, exploration, 4 if exploration == "c3po" else 1, 8, prompts=3, max_new_tokens=8)
    before = {n: p.detach().cpu().clone() for n, p in cpu.named}
    for learner in (cpu, dev):
        result = step(learner, groups)
        assert result.step == 1
    for name, p in cpu.named:
        moved_cpu = p.detach() - before[name]
        moved_dev = dict(dev.named)[name].detach().cpu() - before[name]
        assert float((moved_dev - moved_cpu).norm()) <= 1e-3 * float(moved_cpu.norm()) + 1e-7, name
    if exploration == "c3po":  # IVON's σ follows its h: the same on both
        for name in before:
            torch.testing.assert_close(dev.optimizer.ivon.sigma_by_name()[name].cpu(), cpu.optimizer.ivon.sigma_by_name()[name], rtol=1e-3, atol=0)


def test_the_hf_engine_serves_slots_on_the_device_with_its_checks(tiny_dense_path):
    cfg = dict(batch_size=16, seed=2)
    cpu = HFEngine(tiny_dense_path, SamplerConfig(**cfg))
    dev = HFEngine(tiny_dense_path, SamplerConfig(**cfg, device=TARGET))
    mean = {n: p.detach().cpu().numpy().copy() for n, p in cpu._params.items()}
    sigma = {n: (abs(a) * 0.01 + 1e-4).astype("float32") for n, a in mean.items()}
    checksum = weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    for engine in (cpu, dev):
        engine.load_version(1, mean, sigma, checksum)
    slots = [NoiseSpec(1, seed=11), NoiseSpec(1, seed=12, scale=2.0)]
    for noise in slots:  # the same θ̂ bits on both devices
        assert cpu.serve(noise).loaded_ok and dev.serve(noise).loaded_ok and dev.verify()
        assert (weight_checks.weights_checksum((n, t.cpu()) for n, t in dev.served().items())
                == weight_checks.weights_checksum(cpu.served().items()))
    groups = [(noise, [EngineRequest((5, 6, 7), 4, seed=1)]) for noise in slots]
    params = SamplingParams(max_new_tokens=6)
    for (report, unchanged, samples), (cpu_report, _, cpu_samples) in zip(dev.generate_slots(groups, params),
                                                                         cpu.generate_slots(groups, params)):
        assert report.loaded_ok and unchanged and report == cpu_report
        first = [s.logprobs[0] for s in samples[0]]
        if [s.token_ids[0] for s in samples[0]] == [s.token_ids[0] for s in cpu_samples[0]]:
            assert first == pytest.approx([s.logprobs[0] for s in cpu_samples[0]], abs=1e-3)
