"""The vLLM engine's path for workers in other processes (tensor_parallel_size > 1), on the CPU without
vLLM: (m, σ) staged once per version as a safetensors file and sent by path (msgpack-safe, as vLLM
0.33's multiprocess collective_rpc needs), mapped by every worker, θ̂ streamed tensor by tensor into
the reload path; and the memory accounting: nothing on the device, the staged file shared by ranks."""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import msgpack
import numpy as np
import torch

from threepo.algorithms import param_noise, weight_checks
from threepo.services.sampling.engines.base import SamplerConfig
from threepo.services.sampling.engines.staging import mapped_safetensors, stage_version
from threepo.services.sampling.engines.vllm_engine import VLLMEngine
from threepo.services.sampling.engines.vllm_worker import ThreepoWorkerExtension
from threepo.services.wire.messages import NoiseSpec


class Worker(ThreepoWorkerExtension):
    """What the extension needs of a vLLM worker: its model, device, dtype, TP size and reload path."""

    def __init__(self, tp: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        self.device, self.model_config = torch.device("cpu"), SimpleNamespace(dtype=torch.float32)
        self.parallel_config = SimpleNamespace(tensor_parallel_size=tp)
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.streamed = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.streamed.append(inspect.isgenerator(weights_iterator))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights_iterator:
                params[name].copy_(t)


class MsgpackLLM:
    """`LLM.collective_rpc` as vLLM 0.33 runs it with workers in other processes: the arguments go
    through msgpack (numpy arrays would not survive), then every worker runs the method."""

    def __init__(self, workers):
        self.workers = workers

    def collective_rpc(self, method, args=()):
        args = msgpack.unpackb(msgpack.packb(list(args)))  # raises TypeError on numpy arrays
        return [getattr(w, method)(*args) for w in self.workers]

    def reset_prefix_cache(self):
        pass


def _posterior():
    gen = torch.Generator().manual_seed(1)
    shapes = {"0.weight": (5, 6), "0.bias": (5,), "1.weight": (3, 5), "1.bias": (3,)}
    mean = {n: torch.randn(s, generator=gen).numpy() for n, s in shapes.items()}
    sigma = {n: np.full(s, 0.01, dtype=np.float32) for n, s in shapes.items()}
    return mean, sigma, weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())


def test_a_staged_version_maps_back_bit_exactly_as_views_of_one_mapping(tmp_path):
    mean, sigma, _ = _posterior()
    path = stage_version(mean, sigma, str(tmp_path), "v1")
    assert os.listdir(tmp_path) == ["v1.safetensors"]  # written whole, then named
    held = mapped_safetensors(path)
    assert set(held) == {f"m/{n}" for n in mean} | {f"s/{n}" for n in sigma}
    for n in mean:
        assert np.array_equal(held[f"m/{n}"].numpy().view(np.int32), mean[n].view(np.int32))
    assert len({t.untyped_storage().data_ptr() for t in held.values()}) == 1  # one mapping, views into it


def test_ranks_load_a_staged_version_by_path_stream_theta_and_hold_nothing_on_their_device(tmp_path, monkeypatch):
    monkeypatch.setattr("threepo.services.sampling.engines.vllm_engine.staging_dir", lambda: str(tmp_path))
    workers = [Worker(tp=2), Worker(tp=2)]
    engine = object.__new__(VLLMEngine)  # the adapter without starting vLLM
    engine._lora = None  # a full-weight version, no LoRA serving
    engine.cfg, engine.engine_id, engine.llm, engine.staged = SamplerConfig(backend="vllm", tensor_parallel_size=2), 0, \
        MsgpackLLM(workers), None
    engine.verify = lambda: all(w.threepo_verify() for w in workers)
    mean, sigma, checksum = _posterior()
    engine.load_version(1, mean, sigma, checksum)
    assert engine.staged and os.path.exists(engine.staged)
    report = engine.serve(NoiseSpec(1, seed=7, scale=2.0))
    assert report.loaded_ok and all(all(w.streamed) for w in workers)
    theta = {n: param_noise.perturbed(torch.from_numpy(m), torch.from_numpy(sigma[n]), 7, n, 2.0) for n, m in mean.items()}
    for w in workers:
        for n, p in w.model.named_parameters():
            assert torch.equal(p.detach(), theta[n]), n
    held = engine.held_bytes()
    assert held["device_bytes_per_rank"] == 0 and held["host_bytes_per_param_per_rank"] == 4.0  # 8 B/param shared by 2
    first = engine.staged
    engine.load_version(2, mean, sigma, checksum)  # a new version: the old file goes
    assert not os.path.exists(first) and os.path.exists(engine.staged)
