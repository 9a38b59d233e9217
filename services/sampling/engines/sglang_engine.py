"""The SGLang engine behind the engine protocol (engines/base.py): SGLang's offline `sglang.Engine`.

The same design as the vLLM engine, through SGLang's weight API as the pinned 0.5.23 implements it
(read in its wheel: `sglang/srt/entrypoints/engine.py`, `managers/scheduler_components/weight_updater.py`,
`layers/sampler.py`). The engine is started with `custom_weight_loader=[...]` naming the loaders of
`engines/sglang_loader.py`, and every weight operation is one `Engine.update_weights_from_tensor(
named_tensors, load_format=<loader>, flush_cache=...)` call, which SGLang runs inside every
tensor-parallel worker as `loader(model, named_tensors)`. 0.5.23 refuses tensor updates outside a
weight-update session, so each call is wrapped in `begin_weight_update()` / `end_weight_update()`.
- `load_version` stages (m, σ) once as a fp32 file in shared memory (engines/staging.py) and sends
  its path with load_format `store` (`update_weights_from_tensor` would move m and σ onto every
  rank's device): each worker maps it, checks the mean's checksum and serves the mean; no worker
  holds m or σ on its device. Tensor-parallel workers must share the node (the file is node-local);
- `serve` sends only the seed and the slot's σ multiplier c with load_format `serve`: each worker
  builds θ̂ = m + c · σ ⊙ z(seed, name) from HF names and feeds it to `model.load_weights` (fusion and
  sharding are SGLang's), then compares the fingerprint of what the model holds with what it fed;
  `flush_cache=True` empties the radix cache, so no KV state computed under other weights is reused;
- `verify` sends load_format `verify`: each worker re-reads its served weights.
A loader never raises (in 0.5.23 that ends the scheduler process): each writes its outcome to a
per-rank status file in a directory this adapter owns (`sglang_loader.STATUS_ENV`), and a call
succeeds only when every rank reported this call's number and ok.

Sampling: per-request `sampling_seed` is honoured by 0.5.23 only with `enable_deterministic_inference`
(otherwise every request samples from the engine's own stream), so the engine is started with it: a
request then reproduces whatever shares its batch, which also switches on SGLang's batch-invariant
kernels. Log-probs: 0.5.23 returns each sampled token's log-prob under softmax(logits / T), before
top-k / top-p truncation and without renormalising over the kept tokens
(`SGLANG_RETURN_ORIGINAL_LOGPROB` unset), which are not the behaviour log-probs of a truncated
distribution: this engine therefore samples at temperature only (top_k 0, top_p 1; the config refuses
others with `sampler.backend=sglang`, and `generate` raises). 0.5.23's `Engine` has no pause or
resume of generation, and threepo needs none: this adapter calls the engine one call at a time.

A LoRA version (the engine started with `adapters` = (rank, slots): `enable_lora`, `max_lora_rank`,
`lora_target_modules=["all"]`, `max_loras_per_batch` = slots + 1 (a base-only request counts), as
0.5.23's `arg_groups/fields/lora.py` names them) never reloads the base: at start the `hold` loader
fingerprints the weights as loaded (what `verify` then compares with); each slot's adapter sample Â, B̂
is loaded with `Engine.load_lora_adapter_from_tensors(name, PEFT-named tensors, config dict)` (0.5.23,
`entrypoints/engine.py`; its tensors go through `LoRAAdapter.initialize_weights_from_tensors`, which
keys layers by the names a PEFT file has), each request names its slot's adapter in `lora_path`, and
`generate_slots` sends a call's slots in one `generate`; a new version unloads the last one's
adapters (`unload_lora_adapter`).

SGLang cannot be installed on the CPU machines this project is built on (CUDA-only wheels): this
adapter runs the conformance suite against a fake of the 0.5.23 `Engine` (tests/engines/fake_sglang.py:
its session rule, its seed rule, its log-prob rule, a loader exception ending the engine), and the
real engine only where `sglang` imports.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np

from threepo.algorithms.param_noise import estimated_noise_ratio
from threepo.services.sampling.engines.base import (EngineRequest, SamplerConfig, ServeReport, WeightsMismatch,
                                                    check_version, received_adapters)
from threepo.services.sampling.engines.sglang_loader import STATUS_ENV
from threepo.services.sampling.engines.staging import remove_staged, stage_version, staging_dir
from threepo.services.wire.messages import GeneratedSample, NoiseSpec, SamplingParams

_LOADER = "threepo.services.sampling.engines.sglang_loader"
LOADERS = {op: f"{_LOADER}.{op}" for op in ("store", "serve", "hold", "verify")}
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
                 engine_factory=None, adapters: tuple[int, int] | None = None):
        self.cfg, self.engine_id = cfg, engine_id
        # the loaders' status files; SGLang's workers inherit the variable when the engine spawns them
        self.status_dir = tempfile.mkdtemp(prefix=f"threepo-sglang-{engine_id}-")
        os.environ[STATUS_ENV] = self.status_dir
        self._calls, self.staged = 0, None
        if engine_factory is None:
            import sglang

            engine_factory = sglang.Engine
        self.engine = engine_factory(
            model_path=model_path, dtype=dtype if cfg.dtype == "auto" else cfg.dtype, tp_size=cfg.tensor_parallel_size,
            mem_fraction_static=cfg.gpu_memory_utilization, random_seed=cfg.seed,
            max_running_requests=cfg.batch_size, context_length=None if cfg.max_model_len == "auto" else cfg.max_model_len,
            custom_weight_loader=list(LOADERS.values()), enable_deterministic_inference=True,
            **({} if adapters is None else dict(  # a slot's adapter, and base-only requests, in one batch
                enable_lora=True, max_lora_rank=adapters[0], lora_target_modules=["all"],
                max_loras_per_batch=adapters[1] + 1, max_loaded_loras=2 * (adapters[1] + 1))))
        self.adapters = adapters
        self._lora: dict | None = None  # the held LoRA version: m, σ, (r, α), noise rank, loaded slot names
        self.version, self.mean_checksum, self._noise_ratio = 0, "", 1.0
        self.served_dtype = dtype if cfg.dtype == "auto" else cfg.dtype
        self.report = ServeReport(0, None, "", True, 1.0, detail="checkpoint as loaded by SGLang")
        if adapters is not None:  # the base is never reloaded: its fingerprint as loaded is the check
            ok, message = self._update([], "hold", flush_cache=False)
            if not ok:
                raise WeightsMismatch(f"engine {engine_id}: could not fingerprint the base: {message}")

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str, noise_rank: int = 0,
                     lora: tuple[int, float] | None = None) -> None:
        if lora is not None:
            return self._load_lora(version, mean, sigma, mean_checksum, noise_rank, lora)
        if self._lora is not None:
            raise WeightsMismatch(f"engine {self.engine_id}: a full version after LoRA versions: this engine "
                                  "serves the base it loaded with adapters")
        import torch

        path = stage_version(mean, sigma, staging_dir(), f"threepo-sglang-{os.getpid()}-{self.engine_id}-v{version}")
        named = [(f"{_CONTROL}/path", torch.tensor(list(path.encode()), dtype=torch.uint8)),
                 control("version", [version]), control("rank", [noise_rank]), checksum_tensor(mean_checksum)]
        ok, message = self._update(named, "store", flush_cache=True)
        if not ok:
            remove_staged(path)
            raise WeightsMismatch(f"engine {self.engine_id}: version {version} refused by a worker: {message}")
        remove_staged(self.staged)  # the workers mapped the new file
        self.staged = path
        self.version, self.mean_checksum = version, mean_checksum
        # the workers hold (m, σ); the served-noise ratio is estimated here from a subsample
        self._noise_ratio = estimated_noise_ratio(mean, sigma or {}, self.served_dtype, seed=version)
        self.report = ServeReport(version, None, mean_checksum, True, 1.0)

    def _load_lora(self, version: int, mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None,
                   mean_checksum: str, noise_rank: int, lora: tuple[int, float]) -> None:
        """A LoRA version: the adapters' m and σ kept here (adapter-sized); each slot's adapter sample
        is loaded into SGLang by `load_lora_adapter_from_tensors` under its own name; the previous
        version's adapters are unloaded."""
        if self.adapters is None:
            raise ValueError(f"engine {self.engine_id}: a LoRA version reached an SGLang engine started without "
                             "LoRA serving (the sampler starts it with [lora] rank > 0)")
        held, held_sigma = received_adapters(self.engine_id, version, mean, sigma, mean_checksum)
        for name in (self._lora or {}).get("loaded", {}).values():
            self.engine.unload_lora_adapter(name)
        self._lora = {"mean": held, "sigma": held_sigma, "noise_rank": noise_rank, "lora": lora, "loaded": {}}
        self.version, self.mean_checksum = version, mean_checksum
        self.report = self.serve(NoiseSpec(posterior_version=version, seed=None))

    def _adapter(self, seed: int | None, scale: float) -> tuple[str, bool, str]:
        """The name of slot (seed, c)'s adapter in SGLang, loaded if it is not; (name, ok, message)."""
        from threepo.algorithms import param_noise
        from threepo.services.model.lora import adapter_config, peft_config_dict, peft_tensors

        held = self._lora
        if (seed, scale) in held["loaded"]:
            return held["loaded"][(seed, scale)], True, ""
        values = param_noise.perturbed_state(held["mean"], held["sigma"] or {}, seed, scale, held["noise_rank"])
        name = f"threepo-{self.engine_id}-v{self.version}-{seed}x{scale!r}"
        out = self.engine.load_lora_adapter_from_tensors(name, peft_tensors(values),
                                                         peft_config_dict(adapter_config(values, *held["lora"])))
        if not out.success:
            return name, False, str(out.error_message)
        held["loaded"][(seed, scale)] = name
        return name, True, ""

    def serve(self, noise: NoiseSpec) -> ServeReport:
        check_version(self.engine_id, self.version, noise, bool(self.mean_checksum))
        if self._lora is not None:
            _, ok, message = self._adapter(noise.seed, noise.scale)
            self.report = ServeReport(self.version, noise.seed, self.mean_checksum, ok, 1.0, detail=message,
                                      scale=noise.scale)
            return self.report
        seed = [] if noise.seed is None else [noise.seed]
        ok, message = self._update([control("seed", seed), scale_tensor(noise.scale)], "serve", flush_cache=True)
        ratio = 1.0 if noise.seed is None else self._noise_ratio  # estimated at c = 1
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum, ok, ratio,
                                  detail="" if ok else message, scale=noise.scale)
        return self.report

    def _update(self, named: list, op: str, *, flush_cache: bool) -> tuple[bool, str]:
        """One loader call in every worker, inside a weight-update session; it succeeded when SGLang
        took it and every rank's status file reports this call ok."""
        self._calls += 1
        named = [*named, control("call", [self._calls])]
        began, message = self.engine.begin_weight_update()
        if not began:
            return False, f"begin_weight_update: {message}"
        try:
            ok, message = self.engine.update_weights_from_tensor(named, load_format=LOADERS[op], flush_cache=flush_cache)
        finally:
            self.engine.end_weight_update()
        if not ok:
            return False, str(message)
        return self._reports()

    def _reports(self) -> tuple[bool, str]:
        reports = {}
        for path in glob.glob(os.path.join(self.status_dir, "rank*.json")):
            with open(path) as f:
                reports[os.path.basename(path)] = json.load(f)
        current = {rank: r for rank, r in reports.items() if r["call"] == self._calls}
        if len(current) < self.cfg.tensor_parallel_size:
            return False, (f"{self.cfg.tensor_parallel_size - len(current)} of {self.cfg.tensor_parallel_size} "
                           f"workers did not report call {self._calls} in {self.status_dir}")
        failed = [f"{rank}: {r['message']}" for rank, r in sorted(current.items()) if not r["ok"]]
        return (False, "; ".join(failed)) if failed else (True, "")

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        adapter = None if self._lora is None else self._lora["loaded"][(self.report.seed, self.report.scale)]
        return self._generate(requests, params, [adapter] * len(requests))

    @property
    def slots_together(self) -> bool:
        """Can `generate_slots` sample several slots in one call (a LoRA version: one adapter per slot)?"""
        return self._lora is not None

    def generate_slots(self, groups: Sequence[tuple[NoiseSpec, Sequence[EngineRequest]]],
                       params: SamplingParams) -> list[tuple[ServeReport, bool, list[list[GeneratedSample]]]]:
        """Sample each (slot, requests) group under its own adapter in one `Engine.generate` (each
        request names its slot's adapter in `lora_path`). Per group: the `ServeReport` `serve` would
        give, whether the base was unchanged after sampling, and the samples. A LoRA version only."""
        if self._lora is None:
            raise ValueError(f"engine {self.engine_id}: SGLang samples several slots in one call only for a LoRA "
                             "version; serve and generate them one at a time")
        reports, requests, adapters = [], [], []
        for noise, group in groups:
            check_version(self.engine_id, self.version, noise)
            name, ok, message = self._adapter(noise.seed, noise.scale)
            reports.append(ServeReport(self.version, noise.seed, self.mean_checksum, ok, 1.0, detail=message,
                                       scale=noise.scale))
            requests += group
            adapters += [name] * len(group)
        samples = self._generate(requests, params, adapters)
        unchanged = self.verify()
        out, at = [], 0
        for report, (_, group) in zip(reports, groups):
            out.append((report, unchanged, samples[at:at + len(group)]))
            at += len(group)
        return out

    def _generate(self, requests: Sequence[EngineRequest], params: SamplingParams,
                  adapters: list) -> list[list[GeneratedSample]]:
        if params.top_k or params.top_p < 1:
            raise ValueError(f"engine {self.engine_id}: SGLang 0.5.23 reports log-probs before top-k/top-p "
                             f"truncation; sample with temperature only (got top_k {params.top_k}, top_p {params.top_p})")
        # one SGLang request per sample: sample j of a request draws from seed + j, as in vLLM
        flat = [(r, j) for r in requests for j in range(r.n)]
        sampling = [{"temperature": params.temperature,
                     "max_new_tokens": params.max_new_tokens, "sampling_seed": (r.seed + j) % (1 << 63),
                     "stop_token_ids": list(params.stop_token_ids)}
                    for r, j in flat]
        lora = {} if self._lora is None else {
            "lora_path": [a for r, a in zip(requests, adapters) for _ in range(r.n)]}
        outputs = self.engine.generate(input_ids=[list(r.prompt_ids) for r, _ in flat], sampling_params=sampling,
                                       return_logprob=True, **lora)
        samples = [_sample(o) for o in outputs]
        out, at = [], 0
        for r in requests:
            out.append(samples[at:at + r.n])
            at += r.n
        return out

    def verify(self) -> bool:
        ok, _ = self._update([control("verify", [])], "verify", flush_cache=False)
        return ok

    def close(self) -> None:
        self.engine.shutdown()
        import shutil

        shutil.rmtree(self.status_dir, ignore_errors=True)
        remove_staged(self.staged)


def _sample(output: dict) -> GeneratedSample:
    meta = output["meta_info"]
    tokens = tuple(int(t) for _, t, *_ in meta["output_token_logprobs"])
    logprobs = tuple(float(lp) for lp, *_ in meta["output_token_logprobs"])
    finish = "stop" if meta["finish_reason"]["type"] == "stop" else "length"
    return GeneratedSample(token_ids=tokens, logprobs=logprobs, finish_reason=finish, text=output["text"])
