"""Which weights parameter-space exploration perturbs: a noise mask by parameter name (issue 25;
algorithms.md §2.6).

Careful implementations do not perturb everything: PSN-RLVR perturbs MLP weights, OpenAI's parameter
noise leaves normalisation layers clean, EGGROLL never perturbs embeddings. A served slot is
θ̂ = m + c · σ ⊙ z(seed) on the noised tensors and exactly m elsewhere (σ = 0 there, so m + 0 = m in
any dtype). `noised_names` chooses them:
- never: embeddings (a name with `embed`, `wte` or `wpe`), the output head (`lm_head`), norms (a
  name with `norm` or `ln_`), biases (`.bias`), unless `modules = "everything"` (every parameter:
  the former behaviour);
- `modules`: "all" (every other weight of the decoder layers), "mlp" (the feed-forward weights,
  experts and router included), "attention" (the attention projections);
- `layers` (first, last): the decoder layers noised, inclusive; negative counts from the end
  (-1: the last layer). A tensor outside any decoder layer is noised only under "everything".

`MaskedSigma` is σ on the noised tensors alone (zero, by absence, elsewhere): what the learner
publishes for the engines and what it rebuilds a served slot with. `NoiseConfig` is the run's `[noise]` section: the mask, and how much
noise a slot serves (the target KL its scale is held at: services/learner/noise_control.py) and of
what rank (param_noise.low_rank_noise). Importing this module imports no torch (the config reads it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

NOISE_MODULES = ("all", "mlp", "attention", "everything")
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
_MLP = (".mlp.", ".feed_forward.", ".experts.", ".block_sparse_moe.")
_ATTENTION = (".self_attn.", ".attention.", ".attn.")


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (None: outside the layers)."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def never_noised(name: str) -> bool:
    """Embeddings, the output head, norms and biases (module docstring)."""
    lower = name.lower()
    return (lower.endswith(".bias") or "embed" in lower or "lm_head" in lower or "norm" in lower
            or ".ln_" in lower or lower.startswith("ln_") or ".wte." in lower or ".wpe." in lower)


def noised_names(names: Iterable[str], modules: str = "all", layers: tuple[int, int] = (0, -1)) -> set[str]:
    """The names of `names` that get noise under (`modules`, `layers`); see the module docstring."""
    if modules not in NOISE_MODULES:
        raise ValueError(f"noise.modules: expected one of {NOISE_MODULES}, got {modules!r}")
    if modules == "everything":
        return set(names)
    layer_by_name = {name: layer_of(name) for name in names}
    found = [layer for layer in layer_by_name.values() if layer is not None]
    count = max(found) + 1 if found else 0
    first, last = (i + count if i < 0 else i for i in layers)
    chosen = set()
    for name, layer in layer_by_name.items():
        if layer is None or never_noised(name) or not first <= layer <= last:
            continue
        if modules == "mlp" and not any(part in name for part in _MLP):
            continue
        if modules == "attention" and not any(part in name for part in _ATTENTION):
            continue
        chosen.add(name)
    return chosen


@dataclass(frozen=True)
class NoiseConfig:
    """The run's `[noise]`: which weights a served slot perturbs (`noised_names`): θ̂ = m + c · σ ⊙ z on
    them, exactly m elsewhere. The learner publishes σ with zeros outside the mask, so every engine serves
    it the same way; IVON's own training samples still perturb every weight."""

    modules: Literal["all", "mlp", "attention", "everything"] = "all"
    """all: every weight of the decoder layers except norms and biases (no noise on embeddings or the
    output head); mlp: the feed-forward weights; attention: the attention projections; everything:
    every parameter, embeddings, head, norms and biases included."""
    layers: tuple[int, int] = (0, -1)
    """First and last decoder layer whose weights are perturbed, inclusive; negative counts from the
    end (-1 = the last layer)."""
    target_kl: float | Literal["off"] = 0.01
    """The per-token KL(π_θ̂ ‖ π_m) in nats that served slots are held at (algorithms/noise_scale.py):
    each version serves θ̂ = m + c · σ ⊙ z with IVON's σ as the noise's shape and the scale c set from
    the KL the served slots measured on their own rollouts (by the samplers on the hf engine; by the
    learner on a probe of the latest rollouts for vllm and sglang: services/learner/noise_control.py).
    `off`: no control (c = 1: σ as IVON learned it)."""
    gate: float | Literal["off"] = 4.0
    """A slot whose measured KL exceeds gate × target_kl is redrawn (a new seed, up to 3 times; the
    closest draw is kept if none passes): by the sampler serving it, on its first rollouts, before they
    are used (hf), or by the learner before publishing (vllm, sglang). `off`: no gate; without a
    target (target_kl = "off") there is none."""
    rank: int | Literal["full"] = "full"
    """Rank r of each served slot's noise per matrix: z = Σ_k u_k v_kᵀ / sqrt(r), the same variance per
    element as full noise from (rows + cols) · r draws (algorithms/param_noise.py `low_rank_noise`);
    1-D tensors keep full noise. `full`: full noise. IVON's own training samples are always full."""
    probe_rows: int = 4
    """Rollouts each slot's KL is measured on, over their first 64 tokens: on the hf engine, the first
    rollouts of each slot a sampler serves in a version, its own, probe_rows × 64 tokens' worth (more
    rollouts where they are shorter; each costs an fp32 forward at the slot and at the mean beside
    the call: ~1.2 s per 64-token rollout of SmolLM2-135M on one CPU core); for vllm and sglang,
    rollouts of the latest step, evenly spread over its groups, measured by the learner."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.target_kl != "off" and not self.target_kl > 0:
            raise ValueError(f"noise.target_kl: expected > 0 nats per token, or \"off\" (no control: σ as IVON "
                             f"learned it), got {self.target_kl}")
        if self.gate != "off" and not self.gate > 1:
            raise ValueError(f"noise.gate: expected > 1 (a multiple of noise.target_kl), or \"off\", got {self.gate}")
        if self.rank != "full" and (not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(f"noise.rank: expected an integer >= 1, or \"full\" (full noise), got {self.rank!r}")
        if not isinstance(self.probe_rows, int) or self.probe_rows < 1:
            raise ValueError(f"noise.probe_rows: expected an integer >= 1, got {self.probe_rows!r}")
        if self.modules not in NOISE_MODULES:
            raise ValueError(f"noise.modules: expected one of {NOISE_MODULES}, got {self.modules!r}")
        if len(self.layers) != 2 or not all(isinstance(i, int) for i in self.layers):
            raise ValueError(f"noise.layers: expected [first, last] (integers, -1 = the last layer), got {list(self.layers)}")

    @property
    def controlled(self) -> bool:
        """Is the served slots' KL held at a target (`target_kl` not `off`)?"""
        return self.target_kl != "off"

    @property
    def gate_kl(self) -> float:
        """The per-token KL over which a slot is redrawn: gate × target_kl (inf when either is off)."""
        return self.gate * self.target_kl if self.gate != "off" and self.controlled else math.inf

    @property
    def slot_rank(self) -> int:
        """z's rank per matrix in a served slot as the engines and messages carry it (0: full noise)."""
        return 0 if self.rank == "full" else self.rank


class MaskedSigma(Mapping):
    """σ of `sigmas` on the names in `noised` alone, read when indexed (in `sigmas`' order); a name
    outside the mask is absent: σ is zero there and a slot serves m (nothing drawn, nothing sent)."""

    def __init__(self, sigmas: Mapping, noised: set[str]) -> None:
        self.sigmas, self.noised = sigmas, noised

    def __getitem__(self, name: str):
        if name not in self.noised:
            raise KeyError(name)
        return self.sigmas[name]

    def __contains__(self, name) -> bool:  # without reading σ (Mapping's default reads the item)
        return name in self.noised and name in self.sigmas

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.sigmas if name in self.noised)

    def __len__(self) -> int:
        return sum(1 for _ in self)
