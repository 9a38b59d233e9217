"""The vLLM engine behind the engine protocol (engines/base.py): vLLM's offline `LLM` in-process.

One `vllm.LLM` lives as long as the sampler: a version update or a slot switch reloads weights in
place through the worker extension (engines/vllm_worker.py), never restarts the engine. Sampling
uses vLLM's own scheduler and sampler with `logprobs_mode="processed_logprobs"`, so the reported
behaviour log-probs are those of the distribution actually sampled (after temperature, top-k and
top-p), the quantity the learner's importance weights compare with. Each request carries its own
seed (sample j of a request with n > 1 draws from seed + j, vLLM's rule) and a `cache_salt` of
(version, slot seed and σ multiplier, mean checksum), so the prefix cache can never reuse KV state computed under other
weights; switching weights also resets the cache, which frees blocks that no future request can use.

Weights reach the engine once per version, m and σ in fp32, through Ray's object store into
`load_version`. With one worker (tensor_parallel_size 1) the engine core runs in this process and
the worker takes the arrays by reference. With several, vLLM 0.33 runs the engine core and workers in
other processes and sends `collective_rpc` arguments as msgpack, where numpy arrays arrive as lists
the workers cannot use (`vllm/v1/serial_utils.py`, read in the pinned wheel): the engine then stages
(m, σ) once per version as one safetensors file in shared memory (`/dev/shm` where it exists) and
sends its path; every worker maps it read-only, so the ranks of a node share one copy (8 bytes per
parameter per node, 4 per rank at TP 2) and none holds m or σ on its device (engines/vllm_worker.py;
`held_bytes` reports it). (vLLM's RL weight-transfer API over NCCL/IPC is not used: it loads what it
receives as the served weights, while threepo must hand the workers m and σ and build θ̂ there.)

A LoRA version (`[lora]` rank > 0; the engine started with `adapters` = (rank, slots), which turns
on vLLM's LoRA serving: `enable_lora`, `max_lora_rank` the smallest allowed rank ≥ r, `max_loras` the
slots) never touches the base vLLM loaded: each slot is its adapter sample, written as a PEFT adapter
directory (`LoRAVersion`) and named per request by a `LoRARequest`, and `generate_slots` samples a
call's slots in one `generate` whose prompts each carry their slot's adapter (vLLM's multi-LoRA
batching: the base matmuls shared, each adapter's term added by its punica kernels).

Checked against the pinned 0.33.0 wheel: `LLM(...)`'s arguments are EngineArgs fields there,
`logprobs_mode="processed_logprobs"` exists, `top_k=0` disables top-k, `TokensPrompt` carries
`cache_salt` to the renderer, `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`
hands the iterator to `model.load_weights`, which consumes it as it goes, and inside a sampler actor
(no placement group) tensor_parallel_size > 1 takes the multiprocessing executor
(`vllm/config/parallel.py`), which needs the actor to see that many GPUs (`runtime.sampler_gpus`,
checked by the config). Settings come from `[sampler]`: dtype, eager mode, KV-cache size on CPU, GPU memory fraction, tensor
parallel size, max model length, batch size (max_num_seqs). On CPU, vLLM's process-wide thread
binding is switched off (`VLLM_CPU_OMP_THREADS_BIND=nobind`) and the engine runs with
`sampler.threads` torch threads, like the hf engine; the engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so (m, σ) reach the worker by reference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from threepo.services.sampling.engines.base import (EngineRequest, SamplerConfig, ServeReport, WeightsMismatch,
                                                    check_version, received_adapters)
from threepo.services.sampling.engines.staging import remove_staged, stage_version, staging_dir
from threepo.services.wire.messages import GeneratedSample, NoiseSpec, SamplingParams

WORKER_EXTENSION = "threepo.services.sampling.engines.vllm_worker.ThreepoWorkerExtension"


def configure_environment(cfg: SamplerConfig) -> None:
    """vLLM reads these once, at import or engine start: set them before either."""
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.tensor_parallel_size == 1 else "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    if cfg.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # vLLM 0.33's batch-invariant kernels (vllm/envs.py)
    torch.set_num_threads(cfg.threads)  # vLLM's CPU worker disables set_num_threads once it starts


class VLLMEngine:
    """Serves one policy of a local HF checkpoint with vLLM; see the module docstring."""

    def __init__(self, model_path: str, cfg: SamplerConfig, *, engine_id: int = 0, dtype: str = "float32",
                 adapters: tuple[int, int] | None = None):
        """`adapters` = (rank, slots): serve LoRA versions (`load_version(..., lora=...)`) through vLLM's
        multi-LoRA path, up to `slots` adapters of that rank resident at once."""
        configure_environment(cfg)
        from vllm import LLM

        self.cfg, self.engine_id, self.model_path = cfg, engine_id, model_path
        self.dtype = dtype if cfg.dtype == "auto" else cfg.dtype
        lora = {} if adapters is None else dict(
            enable_lora=True, max_lora_rank=min(r for r in _LORA_RANKS if r >= adapters[0]),
            max_loras=adapters[1], max_cpu_loras=2 * adapters[1])  # this version's slots and the last one's
        self.llm = LLM(model=model_path, dtype=self.dtype, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
                       logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                       gpu_memory_utilization=cfg.gpu_memory_utilization,
                       tensor_parallel_size=cfg.tensor_parallel_size, max_num_seqs=cfg.batch_size,
                       max_model_len=None if cfg.max_model_len == "auto" else cfg.max_model_len, enable_prefix_caching=True, **lora)
        self.adapters = adapters
        self._lora: LoRAVersion | None = None  # the held LoRA version (load_version with lora)
        if adapters is not None:  # the base is never reloaded: its fingerprint as loaded is the check
            self.llm.collective_rpc("threepo_hold_base")
        self.tokenizer = self.llm.get_tokenizer()
        self.version, self.mean_checksum = 0, ""
        self.report = ServeReport(0, None, "", True, 1.0, detail="checkpoint as loaded by vLLM")
        self.starts = 1  # constant: a version or slot never restarts the engine
        self.staged: str | None = None  # the staged (m, σ) file workers in other processes map

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str, noise_rank: int = 0,
                     lora: tuple[int, float] | None = None) -> None:
        if lora is not None:
            return self._load_lora(version, mean, sigma, mean_checksum, noise_rank, lora)
        if self._lora is not None:
            raise WeightsMismatch(f"engine {self.engine_id}: a full version after LoRA versions: this engine "
                                  "serves the base it loaded with adapters")
        if self.cfg.tensor_parallel_size > 1:  # workers in other processes: a staged file, by path
            path = stage_version(mean, sigma, staging_dir(), f"threepo-vllm-{os.getpid()}-{self.engine_id}-v{version}")
            args = (version, path, None, mean_checksum, noise_rank)
        else:
            path, args = None, (version, dict(mean), None if sigma is None else dict(sigma), mean_checksum, noise_rank)
        try:
            received = self.llm.collective_rpc("threepo_load_version", args=args)
        except BaseException:
            remove_staged(path)
            raise
        wrong = [c for c in received if c != mean_checksum]
        if wrong:
            remove_staged(path)
            raise WeightsMismatch(f"engine {self.engine_id}: the mean of version {version} has checksum "
                                  f"{wrong[0]} on a worker, the learner published {mean_checksum}")
        remove_staged(self.staged)  # the workers mapped the new file; the old mapping went with the old tensors
        self.staged = path
        self.version, self.mean_checksum = version, mean_checksum
        self.llm.reset_prefix_cache()
        self.report = ServeReport(version, None, mean_checksum, self.verify(), 1.0)

    def _load_lora(self, version: int, mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None,
                   mean_checksum: str, noise_rank: int, lora: tuple[int, float]) -> None:
        """A LoRA version: the adapters' m and σ, kept here (adapter-sized); each slot is written as a
        PEFT adapter directory that vLLM loads beside the base it never reloads."""
        if self.adapters is None:
            raise ValueError(f"engine {self.engine_id}: a LoRA version reached a vLLM engine started without "
                             "LoRA serving (the sampler starts it with [lora] rank > 0)")
        if lora[0] > self.adapters[0]:
            raise ValueError(f"engine {self.engine_id}: LoRA rank {lora[0]} > the rank it was started for ({self.adapters[0]})")
        held, held_sigma = received_adapters(self.engine_id, version, mean, sigma, mean_checksum)
        self._lora = LoRAVersion(version, held, held_sigma, lora, noise_rank, self.model_path,
                                 f"threepo-vllm-lora-{os.getpid()}-{self.engine_id}-v{version}", self._lora, self.dtype,
            None if self.cfg.tensor_parallel_size > 1 else
            (lambda lora_id: self.llm.collective_rpc("threepo_lora_fingerprint", args=(lora_id,))))
        self.version, self.mean_checksum = version, mean_checksum
        self.report = self.serve(NoiseSpec(posterior_version=version, seed=None))

    def serve(self, noise: NoiseSpec) -> ServeReport:
        check_version(self.engine_id, self.version, noise, bool(self.mean_checksum))
        if self._lora is not None:
            ok, ratio = self._lora.stage(noise.seed, noise.scale)
            self.report = ServeReport(self.version, noise.seed, self.mean_checksum, ok, ratio, scale=noise.scale)
            return self.report
        results = self.llm.collective_rpc("threepo_serve", args=(noise.seed, noise.scale))
        self.llm.reset_prefix_cache()
        intended = sum(r["noise_intended"] for r in results)
        ratio = math.sqrt(sum(r["noise_served"] for r in results) / intended) if intended else 1.0
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum,
                                  all(r["loaded_ok"] for r in results), ratio, scale=noise.scale)
        return self.report

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        prompts, sampling = self._inputs(requests, params, self.report.seed, self.report.scale)
        lora = None if self._lora is None else self._lora.request(self.report.seed, self.report.scale)
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=lora)
        return [[_sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def _inputs(self, requests: Sequence[EngineRequest], params: SamplingParams, seed: int | None, scale: float):
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        salt = f"v{self.version}-s{seed}x{scale!r}-{self.mean_checksum[:8]}"
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids), cache_salt=salt) for r in requests]
        sampling = [VllmParams(n=r.n, seed=r.seed % (1 << 63), temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_new_tokens,
                               stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=True,
                               skip_special_tokens=True)
                    for r in requests]
        return prompts, sampling

    @property
    def slots_together(self) -> bool:
        """Can `generate_slots` sample several slots in one call (a LoRA version: one adapter per slot)?"""
        return self._lora is not None

    def generate_slots(self, groups: Sequence[tuple[NoiseSpec, Sequence[EngineRequest]]],
                       params: SamplingParams) -> list[tuple[ServeReport, bool, list[list[GeneratedSample]]]]:
        """Sample each (slot, requests) group under its own adapter in one `LLM.generate` call (vLLM's
        multi-LoRA batching: each prompt names its slot's `LoRARequest`). Per group: the `ServeReport`
        that `serve` would give, whether its adapter file and the base were unchanged after sampling,
        and the samples. Only for a LoRA version (`slots_together`)."""
        if self._lora is None:
            raise ValueError(f"engine {self.engine_id}: vLLM samples several slots in one call only for a LoRA "
                             "version; serve and generate them one at a time")
        prompts, sampling, loras, reports, counts = [], [], [], [], []
        for noise, requests in groups:
            check_version(self.engine_id, self.version, noise)
            ok, ratio = self._lora.stage(noise.seed, noise.scale)
            reports.append(ServeReport(self.version, noise.seed, self.mean_checksum, ok, ratio, scale=noise.scale))
            p, s = self._inputs(requests, params, noise.seed, noise.scale)
            prompts += p
            sampling += s
            loras += [self._lora.request(noise.seed, noise.scale)] * len(p)
            counts.append(len(p))
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=loras)
        base_ok = all(self.llm.collective_rpc("threepo_verify"))
        results, at = [], 0
        for (noise, _), report, n in zip(groups, reports, counts):
            samples = [[_sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs[at:at + n]]
            results.append((report, base_ok and self._lora.holds(noise.seed, noise.scale), samples))
            at += n
        return results

    def verify(self) -> bool:
        if self._lora is not None:  # the base as loaded, and the served slot's adapter as written
            return self._lora.holds(self.report.seed, self.report.scale) and all(self.llm.collective_rpc("threepo_verify"))
        return all(self.llm.collective_rpc("threepo_verify"))

    def held_bytes(self) -> dict:
        """threepo's own memory beside the served weights, per worker: on its device, and in host
        memory mapped or referenced (shared by the workers of a staged file), with bytes per parameter
        per rank of each (host: the staged file's share)."""
        workers = self.llm.collective_rpc("threepo_held_bytes")
        ranks, params = len(workers), workers[0]["parameters"]
        device = max(w["device"] for w in workers)
        host = workers[0]["host_mapped"] / (ranks if self.staged else 1)
        return {"ranks": ranks, "device_bytes_per_rank": device, "host_bytes_per_rank": host,
                "device_bytes_per_param_per_rank": device / params if params else 0.0,
                "host_bytes_per_param_per_rank": host / params if params else 0.0}

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()
        remove_staged(self.staged)
        if self._lora is not None:
            self._lora.remove()


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank (vllm/config/lora.py)


class LoRAVersion:
    """A LoRA version as the vLLM engine holds it: the adapters' fp32 m and σ (the learner's names),
    (r, α), and each slot staged as a PEFT adapter directory (`services/lora.write_adapter`) of its
    sample Â = m_A + c · σ_A ⊙ z(seed), B̂ likewise (`param_noise.perturbed`, as the learner and the hf
    engine build them), under `staging_dir()/<stem>-<seed>x<c>`, and named to vLLM by a `LoRARequest`
    whose id is new for every (version, slot); vLLM casts them to the served dtype (its `lora_dtype`
    default), which the served-noise ratio accounts for. The weight check (`holds`): the fingerprint of
    the values written against the file read back until vLLM has loaded the adapter (at the first
    request naming it), then against what its worker holds: Â and s · B̂ in the served dtype, the scaling
    folded into lora_b as vLLM's `LoRALayerWeights.optimize` does (one rank; with tensor parallelism
    each rank holds shards, and the file check alone applies). The previous version's directories are removed when this
    version is taken (vLLM read them when their slots were served; an older version's requests are
    served after it is taken again)."""

    _ids = iter(range(1, 1 << 62))  # vLLM caches adapters by id: one per staged slot, process-wide

    def __init__(self, version: int, mean: dict, sigma: dict | None, lora: tuple[int, float], noise_rank: int,
                 base_path: str, stem: str, previous: LoRAVersion | None, dtype: str = "float32",
                 held=None) -> None:
        """`held(lora_id)`: each worker's fingerprint of that adapter as loaded (None: not loaded),
        or None where the workers hold shards."""
        self.version, self.mean, self.sigma, self.lora, self.noise_rank = version, mean, sigma, lora, noise_rank
        self.dtype, self.held = dtype, held
        self.base_path, self.stem = base_path, stem
        self.slots: dict[tuple, tuple] = {}  # (seed, c) -> (LoRARequest, directory, fingerprint, ratio, as loaded)
        if previous is not None:
            previous.remove()

    def stage(self, seed: int | None, scale: float) -> tuple[bool, float]:
        """Write slot (seed, c) if it is not staged; (whether the file holds what was computed, the
        served-noise ratio of the adapter factors in the served dtype)."""
        import torch
        from vllm.lora.request import LoRARequest

        from threepo.algorithms import param_noise, weight_checks
        from threepo.services.model.lora import adapter_config, write_adapter

        key = (seed, scale)
        if key not in self.slots:
            values = param_noise.perturbed_state(self.mean, self.sigma or {}, seed, scale, self.noise_rank)
            directory = os.path.join(staging_dir(), f"{self.stem}-{seed}x{scale!r}")
            write_adapter(values, adapter_config(values, *self.lora), directory, self.base_path)
            request = LoRARequest(f"{self.stem}-{seed}x{scale!r}", next(self._ids), directory)
            ratio = param_noise.served_noise_ratio_of(self.mean, values, getattr(torch, self.dtype)) if (
                seed is not None and self.sigma) else 1.0
            self.slots[key] = (request, directory, weight_checks.value_fingerprint(values.values()), ratio,
                               self._as_loaded(values))
        return self.holds(seed, scale), self.slots[key][3]

    def _as_loaded(self, values: dict) -> tuple[int, int]:
        """The fingerprint vLLM's copy of these adapters must have: Â, and B̂ times s = α / r, in the served dtype."""
        import torch

        from threepo.algorithms import weight_checks

        dtype, scaling = getattr(torch, self.dtype), self.lora[1] / self.lora[0]
        parts = [t.to(dtype) if ".lora_A." in n else (t.to(dtype).mul_(scaling) if scaling != 1 else t.to(dtype))
                 for n, t in values.items()]
        return weight_checks.value_fingerprint(parts)

    def request(self, seed: int | None, scale: float):
        return self.slots[(seed, scale)][0]

    def holds(self, seed: int | None, scale: float) -> bool:
        """Does slot (seed, c)'s adapter hold exactly the values computed for it: as vLLM's workers hold
        it once they loaded it, else (not loaded yet, or workers holding shards) as its file does?"""
        from safetensors.torch import load_file

        from threepo.algorithms import weight_checks

        request, directory, fingerprint, _, loaded = self.slots[(seed, scale)]
        held = [] if self.held is None else self.held(request.lora_int_id)
        if held and all(h is not None for h in held):  # what serves: no need to read the file again
            return all(tuple(h) == loaded for h in held)
        written = load_file(os.path.join(directory, "adapter_model.safetensors"))
        return weight_checks.value_fingerprint(written.values()) == fingerprint

    def remove(self) -> None:
        import shutil

        for _, directory, *_ in self.slots.values():
            shutil.rmtree(directory, ignore_errors=True)
        self.slots.clear()


def _sample(c) -> GeneratedSample:
    """One vLLM CompletionOutput: the sampled token's processed log-prob at each position (a stop
    token from `stop_token_ids` is kept as the last token, as an EOS is)."""
    logprobs = tuple(float(step[token].logprob) for token, step in zip(c.token_ids, c.logprobs))
    finish = "stop" if c.finish_reason == "stop" else "length"
    return GeneratedSample(token_ids=tuple(c.token_ids), logprobs=logprobs, finish_reason=finish, text=c.text)
