"""Engines under the conformance suite, one per backend per session.

`hf` runs in-process. `vllm` runs inside a Ray actor on the session cluster — where a sampler runs
it — so that vLLM's process-wide settings (it disables torch.set_num_threads, freezes the GC, sets
up torch.distributed) never leak into the test process; `RemoteEngine` forwards each protocol call.
`sglang` is built only where the `sglang` package imports (a CUDA machine); elsewhere its tests are
skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from threepo.services.sampling.engines.base import SamplerConfig

# sglang_fake: the real SGLang adapter and loaders over a fake of sglang.Engine's documented calls
BACKENDS = ("hf", "vllm", "sglang", "sglang_fake")
CFG = dict(batch_size=32, seed=0, max_new_tokens=12)


class EngineHost:
    """A Ray actor holding one engine; `call` runs a protocol method, `rpc` a vLLM worker method."""

    def __init__(self, backend: str, path: str, cfg: SamplerConfig, adapters: tuple | None = None) -> None:
        import os

        from threepo.deploy.actors import make_engine

        self.pid = os.getpid()
        self.engine = make_engine(path, cfg, 0, "float32", adapters)

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)

    def rpc(self, method: str, *args):
        return self.engine.llm.collective_rpc(method, args=args)

    def run(self, fn, *args) -> list:
        """`fn(worker, *args)` in every vLLM worker (`collective_rpc` with a callable)."""
        return self.engine.llm.collective_rpc(fn, args=args)

    def lora_id(self, seed, scale: float) -> int:
        """vLLM's id of the held LoRA version's slot (seed, scale)."""
        return self.engine._lora.slots[(seed, scale)][0].lora_int_id

    def corrupt(self, scale: float) -> list:
        """Fault injection inside every vLLM worker (a callable given to `collective_rpc` runs with the
        worker as its first argument): scale one element of its first readable weight in place."""
        return self.engine.llm.collective_rpc(corrupt_first_weight, args=(scale,))

    def chat_ids(self, messages: list) -> list:
        """What vLLM's own chat path makes of `messages`: its tokenizer renders the model's template,
        then tokenizes the text without adding special tokens (`LLM.chat`)."""
        tokenizer = self.engine.llm.get_tokenizer()
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)

    def identity(self) -> tuple[int, int]:
        """(process id, id of the backend's engine object): unchanged unless the engine restarted."""
        return self.pid, id(self.engine.llm)


def corrupt_first_weight(worker, scale: float) -> str:
    import torch

    for name, p in worker.model_runner.get_model().named_parameters():
        if p.numel():
            with torch.no_grad():
                p.view(-1)[0] *= scale
            return name
    raise RuntimeError("no readable parameter to corrupt")


class RemoteEngine:
    """The engine protocol over an `EngineHost` actor."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __getattr__(self, method):
        import ray

        return lambda *args: ray.get(self.actor.call.remote(method, *args))

    def rpc(self, method, *args):
        import ray

        return ray.get(self.actor.rpc.remote(method, *args))

    def corrupt(self, scale: float) -> list:
        import ray

        return ray.get(self.actor.corrupt.remote(scale))

    def run(self, fn, *args) -> list:
        import ray

        return ray.get(self.actor.run.remote(fn, *args))

    def lora_id(self, seed, scale: float) -> int:
        import ray

        return ray.get(self.actor.lora_id.remote(seed, scale))

    def identity(self):
        import ray

        return ray.get(self.actor.identity.remote())


def _missing(backend: str) -> str | None:
    module = {"vllm": "vllm", "sglang": "sglang"}.get(backend)
    if module and importlib.util.find_spec(module) is None:
        return (f"{module} is not installed here" + (" (CUDA-only wheels; docs/architecture.md §9)" if module == "sglang"
                                                     else " (install: README, 'vLLM engine on CPU')"))
    if backend == "sglang":
        import torch

        if not torch.cuda.is_available():
            return "sglang needs a CUDA device"
    return None


@pytest.fixture(scope="session", params=BACKENDS)
def engine(request, tiny_dense_path):
    backend = request.param
    reason = _missing(backend)
    if reason:
        pytest.skip(f"{backend}: {reason}")
    cfg = SamplerConfig(backend=backend.removesuffix("_fake"), **CFG)
    if backend == "sglang_fake":
        from fake_sglang import FakeSGLangEngine

        from threepo.services.sampling.engines.sglang_engine import SGLangEngine

        eng = SGLangEngine(tiny_dense_path, cfg, engine_factory=FakeSGLangEngine)
        eng.identity = lambda: (0, id(eng.engine))
        yield backend, eng
        return
    if backend == "hf":
        from threepo.services.sampling.engines.hf import HFEngine

        eng = HFEngine(tiny_dense_path, cfg)
        eng.identity = lambda: (0, id(eng.model))
        yield backend, eng
        return
    ray = request.getfixturevalue("ray_session")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(EngineHost).options(num_cpus=0).remote(backend, tiny_dense_path, cfg)
    remote = RemoteEngine(actor)
    remote.identity()  # wait for the engine to start
    yield backend, remote
    ray.kill(actor)
