"""The SGLang adapter against the pinned 0.5.23's rules (as tests/engines/fake_sglang.py keeps them):
weight calls inside a session, loaders that never raise (an exception would end the scheduler), a
call that fails unless every tensor-parallel rank reported it, temperature-only sampling."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fake_sglang import FakeSGLangEngine

from threepo.algorithms.weight_checks import weights_checksum
from threepo.deploy.config import ConfigError, load_config
from threepo.services.model.modeling import load_model, trainable_named_parameters
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig, WeightsMismatch
from threepo.services.sampling.engines.sglang_engine import SGLangEngine
from threepo.services.wire.messages import NoiseSpec, SamplingParams


def _published(path):
    mean = {n: p.detach().numpy().copy() for n, p in trainable_named_parameters(load_model(path))}
    sigma = {n: np.full(a.shape, 0.01, dtype=np.float32) for n, a in mean.items()}
    return mean, sigma, weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())


def test_a_failed_check_is_reported_and_the_engine_lives_on(tiny_dense_path):
    eng = SGLangEngine(tiny_dense_path, SamplerConfig(backend="sglang"), engine_factory=FakeSGLangEngine)
    mean, sigma, checksum = _published(tiny_dense_path)
    with pytest.raises(WeightsMismatch, match="checksum"):
        eng.load_version(1, mean, sigma, "0" * 16)
    assert not eng.engine.dead and not eng.engine.session  # no exception reached the scheduler; session closed
    eng.load_version(1, mean, sigma, checksum)
    assert eng.serve(NoiseSpec(1, 5)).loaded_ok and eng.verify()
    with torch.no_grad():
        next(eng.engine.model.parameters()).view(-1)[0] += 1.0
    assert not eng.verify() and not eng.engine.dead


def test_a_rank_that_does_not_report_a_call_fails_it(tiny_dense_path):
    eng = SGLangEngine(tiny_dense_path, SamplerConfig(backend="sglang", tensor_parallel_size=2),
                       engine_factory=lambda **kw: FakeSGLangEngine(**{**kw, "tp_size": 1}))
    with pytest.raises(WeightsMismatch, match="1 of 2 workers did not report call 1"):
        eng.load_version(1, *_published(tiny_dense_path))


def test_the_adapter_starts_deterministic_inference_and_refuses_truncated_sampling(tiny_dense_path):
    eng = SGLangEngine(tiny_dense_path, SamplerConfig(backend="sglang"), engine_factory=FakeSGLangEngine)
    assert eng.engine.args["enable_deterministic_inference"]  # else 0.5.23 ignores sampling_seed
    eng.load_version(1, *_published(tiny_dense_path))
    request = [EngineRequest((5, 6, 7), 2, seed=3)]
    first, again = (eng.generate(request, SamplingParams(max_new_tokens=6)) for _ in range(2))
    assert [s.token_ids for s in first[0]] == [s.token_ids for s in again[0]]
    with pytest.raises(ValueError, match="before top-k/top-p truncation"):
        eng.generate(request, SamplingParams(max_new_tokens=6, top_p=0.9))
    with pytest.raises(ConfigError, match="SGLang 0.5.23 reports log-probs before top-k/top-p"):
        load_config(None, ["sampler.backend=sglang", "runtime.sampler_gpus=1", "sampler.top_k=20"])


def test_the_fake_keeps_the_pinned_rules(tiny_dense_path):
    """What would have caught the adapter of before: updates outside a session are refused, and an
    exception in a loader ends the engine."""
    fake = FakeSGLangEngine(model_path=tiny_dense_path, custom_weight_loader=["threepo.services.sampling.engines.sglang_loader.verify"])
    ok, message = fake.update_weights_from_tensor([], load_format="threepo.services.sampling.engines.sglang_loader.verify")
    assert not ok and "begin_weight_update" in message
    assert not hasattr(fake, "pause_generation") and not hasattr(fake, "continue_generation")


def test_a_version_reaches_the_workers_as_a_staged_file_not_as_tensors(tiny_dense_path):
    """update_weights_from_tensor would move every tensor it carries onto each rank's device: the
    adapter sends only control tensors, and the workers map (m, σ) from the staged file."""
    from threepo.services.sampling.engines import sglang_loader

    eng = SGLangEngine(tiny_dense_path, SamplerConfig(backend="sglang"), engine_factory=FakeSGLangEngine)
    sent, update = [], eng.engine.update_weights_from_tensor
    eng.engine.update_weights_from_tensor = lambda named, **kw: (sent.append([n for n, _ in named]), update(named, **kw))[1]
    mean, sigma, checksum = _published(tiny_dense_path)
    eng.load_version(1, mean, sigma, checksum)
    assert all(n.startswith("__threepo__/") for n in sent[0])
    held = sglang_loader._STATE[id(eng.engine.model)]
    storages = {t.untyped_storage().data_ptr() for t in [*held["mean"].values(), *held["sigma"].values()]}
    assert len(storages) == 1  # views of one mapping of the staged file
    first = eng.staged
    eng.load_version(2, mean, sigma, checksum)
    assert not os.path.exists(first) and os.path.exists(eng.staged)
    eng.close()
    assert not os.path.exists(eng.staged)


def test_a_lora_version_is_served_as_sglang_adapters_loaded_from_tensors_as_the_learner_builds_them(tiny_dense_path):
    # the fake applies a request's adapter as SGLang does (W0 x + s B A x); the adapter's calls are
    # 0.5.23's: enable_lora at start, load_lora_adapter_from_tensors / unload_lora_adapter, lora_path per request
    from lora_learners import ivon_lora_learner

    from threepo.services.model.lora import LoRAConfig

    learner = ivon_lora_learner(tiny_dense_path, LoRAConfig(rank=4, alpha=8.0), nudge_seed=9)
    model = learner.model.eval()
    pv = learner.published()
    eng = SGLangEngine(tiny_dense_path, SamplerConfig(backend="sglang"), engine_factory=FakeSGLangEngine,
                       adapters=(4, 2))
    assert eng.engine.args["enable_lora"] and eng.engine.args["max_loras_per_batch"] == 3
    with pytest.raises(WeightsMismatch, match="checksum"):
        eng.load_version(1, pv.mean, pv.sigma, "0" * 16, 0, pv.lora)
    eng.load_version(1, pv.mean, pv.sigma, pv.mean_checksum, 0, pv.lora)
    params = SamplingParams(max_new_tokens=6)
    for seed, scale in ((None, 1.0), (7, 1.0), (7, 2.5)):
        assert eng.serve(NoiseSpec(1, seed=seed, scale=scale)).loaded_ok and eng.verify()
        sample = eng.generate([EngineRequest((5, 6, 7), 1, seed=3)], params)[0][0]
        full = torch.tensor([[5, 6, 7, *sample.token_ids]])
        with torch.no_grad():
            if seed is None:
                logits = model(input_ids=full).logits
            else:
                with learner.optimizer.at(seed, train=False, scale=scale, served=True):
                    logits = model(input_ids=full).logits
        want = torch.log_softmax(logits[0, 2:-1], -1).gather(1, full[0, 3:, None])[:, 0].numpy()
        np.testing.assert_allclose(sample.logprobs, want, atol=1e-4)
    groups = [(NoiseSpec(1, seed=s), [EngineRequest((5, 6), 2, seed=20 + s)]) for s in (7, 8)]
    together = eng.generate_slots(groups, params)
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        assert report.loaded_ok and unchanged
        eng.serve(noise)
        assert [[s.token_ids for s in r] for r in samples] == [[s.token_ids for s in r] for r in eng.generate(requests, params)]
    assert len(eng.engine.loras) == 4  # the mean, (7, 1), (7, 2.5), (8, 1)
    eng.load_version(2, pv.mean, pv.sigma, pv.mean_checksum, 0, pv.lora)
    assert list(eng.engine.loras) == ["threepo-0-v2-Nonex1.0"]  # version 1's adapters unloaded
    with torch.no_grad():
        next(eng.engine.model.parameters()).view(-1)[0] += 1.0  # a stray write into the base
    assert not eng.verify()
