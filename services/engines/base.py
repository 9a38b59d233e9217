"""The sampler-engine protocol that every backend (hf, vllm, sglang) implements, and its config.

An engine serves one policy at a time. It holds the published posterior mean m and σ of one version
(one transfer per version, whatever the number of slots) and, for a slot, serves
θ̂ = m + σ ⊙ z(seed) with z regenerated locally from (seed, parameter name) in fp32; it serves the
clean mean again by copying m back (never by subtracting noise). Switching policy happens only
between `generate` calls — at a request boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np

    from threepo.services.messages import NoiseSpec, SamplingParams


@dataclass(frozen=True)
class SamplerConfig:
    """How sampler engines run and sample."""

    backend: Literal["hf", "vllm", "sglang"] = "hf"
    """Engine backend: `hf` (transformers, CPU default), `vllm` or `sglang` (GPU; optional extras)."""
    temperature: float = 1.0
    """Sampling temperature (the learner computes log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 16
    """Longest completion; a completion cut here has finish_reason `length` and scores malformed."""
    threads: int = 1
    """Torch intra-op threads per engine (several single-thread engines beat one wide one on CPU)."""
    batch_size: int = 64
    """Most sequences decoded together in one forward pass."""
    gpu_memory_utilization: float = 0.5
    """vllm/sglang only: fraction of GPU memory the engine may take."""
    seed: int = 0
    """Seed of the engine's sampling RNG (combined with the engine id)."""
    slot_cache: int = 8
    """hf only: perturbed weight sets kept per version, so switching back to a slot is a copy
    instead of regenerating its noise (0 = always regenerate; each entry is one fp32 model copy)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampler.temperature: expected > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler.top_p: expected in (0, 1], got {self.top_p}")
        for name in ("top_k", "max_new_tokens", "threads", "batch_size", "slot_cache"):
            value = getattr(self, name)
            if value < (0 if name in ("top_k", "slot_cache") else 1):
                raise ValueError(f"sampler.{name}: expected a positive integer, got {value}")


@dataclass(frozen=True)
class GeneratedSample:
    """What an engine returns for one sampled sequence (the Sampler service adds ids and tags)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (EOS sampled) or "length"
    text: str


class Engine(Protocol):
    """One inference engine serving one (perturbed) policy at a time."""

    def update_posterior(self, version: int, mean: Mapping[str, np.ndarray],
                         sigma: Mapping[str, np.ndarray] | None) -> None:
        """Take version `version`: keep fp32 copies of m and σ (σ None: no noise possible)."""

    def serve(self, noise: NoiseSpec) -> str:
        """Serve θ̂ = m + σ ⊙ z(noise.seed) (seed None: the mean); return the weights checksum."""

    def generate(self, prompts: Sequence[str], params: SamplingParams,
                 seed: int | None = None) -> list[list[GeneratedSample]]:
        """`params.n` samples for each prompt from the currently served policy; `seed` (optional)
        makes the call's random draws independent of earlier calls (reproducible runs)."""

    def close(self) -> None:
        """Release the engine's resources."""
