"""The SGLang engine behind the engine protocol (engines/base.py): SGLang's offline `sglang.Engine`.

The same design as the vLLM engine, through SGLang's documented weight API (checked against the
0.5.23 wheel, feasibility.md): the engine is started with `custom_weight_loader=[...]` naming the
loaders of `engines/sglang_loader.py`, and every weight operation is an
`Engine.update_weights_from_tensor(named_tensors, load_format=<loader>, flush_cache=...)` call, which
SGLang runs inside every tensor-parallel worker as `loader(model, named_tensors)`:
- `load_version` sends m and σ (fp32) with load_format `store`: each worker checks the mean's
  checksum, keeps (m, σ) on its device and serves the mean;
- `serve` sends only the seed and the slot's σ multiplier c with load_format `serve`: each worker
  builds θ̂ = m + c · σ ⊙ z(seed, name) from HF names and feeds it to `model.load_weights` (fusion and sharding are SGLang's), then
  compares the fingerprint of what the model holds with what it fed; `flush_cache=True` empties the
  radix cache, so no KV state computed under other weights is reused;
- `verify` sends load_format `verify`: each worker re-reads its served weights.
A worker that finds a mismatch raises, which the adapter treats as a failed check. (SGLang's
`init_weights_update_group` + `update_weights_from_distributed(..., load_format=<store loader>)`
would bring m and σ over NCCL instead of through the object store; not used yet.)

Log-probs: SGLang reports each sampled token's log-prob after temperature scaling
(`SGLANG_RETURN_ORIGINAL_LOGPROB` unset); whether they are renormalised after top-k/top-p is what
the conformance suite checks where SGLang runs. SGLang cannot be installed on the CPU machines this
project is built on (CUDA-only wheels): this adapter is unit-tested against a fake of the documented
`Engine` call signatures (tests/engines/test_sglang_adapter.py) and runs the conformance suite only
where `sglang` imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from threepo.algorithms.param_noise import estimated_noise_ratio
from threepo.services.engines.base import (EngineRequest, GeneratedSample, SamplerConfig, ServeReport,
                                           WeightsMismatch)
from threepo.services.messages import NoiseSpec, SamplingParams

_LOADER = "threepo.services.engines.sglang_loader"
LOADERS = {op: f"{_LOADER}.{op}" for op in ("store", "serve", "verify")}
_CONTROL = "__threepo__"  # prefix of control tensors (seed, version, checksum); never a model weight


def control(name: str, values: Sequence[int]):
    """A control tensor for the loaders: int64 values under a reserved name."""
    import torch

    return (f"{_CONTROL}/{name}", torch.tensor(list(values), dtype=torch.int64))


def scale_tensor(scale: float):
    """A slot's σ multiplier as a float64 control tensor (exact for any Python float)."""
    import torch

    return (f"{_CONTROL}/scale", torch.tensor([scale], dtype=torch.float64))


def checksum_tensor(checksum: str):
    """The hex checksum as int64 values (tensors are all that update_weights_from_tensor carries)."""
    return control("checksum", [int(checksum[i:i + 8], 16) for i in range(0, len(checksum), 8)])


class SGLangEngine:
    """Serves one policy of a local HF checkpoint with SGLang; see the module docstring.
    `engine_factory` builds the `sglang.Engine` (tests pass a fake with the same signatures)."""

    def __init__(self, model_path: str, cfg: SamplerConfig, *, engine_id: int = 0, dtype: str = "float32",
                 engine_factory=None):
        self.cfg, self.engine_id = cfg, engine_id
        if engine_factory is None:
            import sglang

            engine_factory = sglang.Engine
        self.engine = engine_factory(
            model_path=model_path, dtype=dtype if cfg.dtype == "auto" else cfg.dtype, tp_size=cfg.tensor_parallel_size,
            mem_fraction_static=cfg.gpu_memory_utilization, random_seed=cfg.seed,
            max_running_requests=cfg.batch_size, context_length=cfg.max_model_len or None,
            custom_weight_loader=list(LOADERS.values()))
        self.version, self.mean_checksum, self.paused, self._noise_ratio = 0, "", False, 1.0
        self.served_dtype = dtype if cfg.dtype == "auto" else cfg.dtype
        self.report = ServeReport(0, None, "", True, 1.0, detail="checkpoint as loaded by SGLang")

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str) -> None:
        import torch

        named = [(f"m/{n}", torch.from_numpy(np.asarray(a, dtype=np.float32))) for n, a in mean.items()]
        named += [(f"s/{n}", torch.from_numpy(np.asarray(a, dtype=np.float32))) for n, a in (sigma or {}).items()]
        named += [control("version", [version]), checksum_tensor(mean_checksum)]
        ok, message = self._update(named, "store", flush_cache=True)
        if not ok:
            raise WeightsMismatch(f"engine {self.engine_id}: version {version} refused by a worker: {message}")
        self.version, self.mean_checksum = version, mean_checksum
        # the workers hold (m, σ); the served-noise ratio is estimated here from a subsample
        self._noise_ratio = estimated_noise_ratio(mean, sigma or {}, self.served_dtype, seed=version)
        self.report = ServeReport(version, None, mean_checksum, True, 1.0)

    def serve(self, noise: NoiseSpec) -> ServeReport:
        if noise.posterior_version != self.version or not self.mean_checksum:
            raise ValueError(f"engine {self.engine_id} holds version {self.version}, asked to serve "
                             f"{noise.posterior_version}: load_version first")
        seed = [] if noise.seed is None else [noise.seed]
        ok, message = self._update([control("seed", seed), scale_tensor(noise.scale)], "serve", flush_cache=True)
        ratio = 1.0 if noise.seed is None else self._noise_ratio  # estimated at c = 1
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum, ok, ratio,
                                  detail="" if ok else message, scale=noise.scale)
        return self.report

    def _update(self, named: list, op: str, *, flush_cache: bool) -> tuple[bool, str]:
        """One loader call in every worker; a loader that raises is a failed check, however SGLang
        surfaces it (an unsuccessful result or an exception from the call)."""
        try:
            ok, message = self.engine.update_weights_from_tensor(named, load_format=LOADERS[op],
                                                                 flush_cache=flush_cache)
        except RuntimeError as err:
            return False, str(err)
        return bool(ok), str(message)

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        if self.paused:
            raise RuntimeError(f"engine {self.engine_id} is paused: resume() before generate")
        # one SGLang request per sample: sample j of a request draws from seed + j, as in vLLM
        flat = [(r, j) for r in requests for j in range(r.n)]
        sampling = [{"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
                     "max_new_tokens": params.max_new_tokens, "sampling_seed": (r.seed + j) % (1 << 63),
                     "stop_token_ids": list(params.stop_token_ids)}
                    for r, j in flat]
        outputs = self.engine.generate(input_ids=[list(r.prompt_ids) for r, _ in flat], sampling_params=sampling,
                                       return_logprob=True)
        samples = [_sample(o) for o in outputs]
        out, at = [], 0
        for r in requests:
            out.append(samples[at:at + r.n])
            at += r.n
        return out

    def verify(self) -> bool:
        ok, _ = self._update([control("verify", [])], "verify", flush_cache=False)
        return ok

    def pause(self) -> None:
        self.engine.pause_generation()
        self.paused = True

    def resume(self) -> None:
        self.engine.continue_generation()
        self.paused = False

    def close(self) -> None:
        self.engine.shutdown()


def _sample(output: dict) -> GeneratedSample:
    meta = output["meta_info"]
    tokens = tuple(int(t) for _, t, *_ in meta["output_token_logprobs"])
    logprobs = tuple(float(lp) for lp, *_ in meta["output_token_logprobs"])
    finish = "stop" if meta["finish_reason"]["type"] == "stop" else "length"
    return GeneratedSample(token_ids=tokens, logprobs=logprobs, finish_reason=finish, text=output["text"])
