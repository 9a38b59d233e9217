"""How the learner steps: the optimizer of its training copy (IVON or AdamW, each with its own
defaults) and the sync budget that decides when a step publishes a new version. Frozen dataclasses
with a docstring per field; the algorithm itself is services/learner/config.py's `AlgoConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer of the learner's training copy. Defaults are tuned for the 0.5M-parameter
    embedded default (algorithms.md §1.3: λ = 1e5, h0 = 0.1 → σ ≈ 0.01, lr 10 rescaled, ξ = 3e-5)."""

    name: Literal["ivon", "adamw"] = "ivon"
    """ivon (a posterior: needed by b3po/m3po/c3po) or adamw (the GRPO baseline)."""
    lr: float | Literal["auto"] = "auto"
    """Learning rate; auto = the optimizer's own (`OWN_DEFAULTS`: IVON 10, rescaled by h0 + δ when
    rescale_lr, so α ≈ 1; AdamW 1e-4; both sized for the embedded default). IVON's and AdamW's scales
    differ by ~1e5: AdamW diverges at IVON's 10."""
    ess: float = 1e5
    """IVON effective sample size λ (weight-space temperature: smaller = more noise)."""
    hess_init: float = 0.1
    """IVON initial Hessian h0."""
    beta1: float = 0.9
    """Momentum coefficient (IVON and AdamW)."""
    beta2: float | Literal["auto"] = "auto"
    """IVON's Hessian EMA or AdamW's second-moment coefficient; auto = the optimizer's own (IVON 0.9999,
    3PO's; AdamW 0.999)."""
    weight_decay: float | Literal["auto"] = "auto"
    """IVON's prior precision δ per unit ESS or AdamW's decoupled weight decay; auto = the optimizer's
    own (IVON 1e-6, 3PO's; AdamW 0)."""
    clip_radius: float = 3e-5
    """IVON elementwise clip ξ of the preconditioned step."""
    rescale_lr: bool = True
    """IVON: effective α = lr · (h0 + δ)."""
    grad_clip: float = 1.0
    """AdamW gradient-norm clip (IVON: not applied; see algorithms.md §1.5 item 6)."""

    def __post_init__(self) -> None:
        for name, value in OWN_DEFAULTS[self.name].items():
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, value)
        for name in ("lr", "ess", "hess_init", "clip_radius"):
            if not getattr(self, name) > 0:
                raise ValueError(f"optim.{name}: expected > 0, got {getattr(self, name)}")
        if not (0 <= self.beta1 < 1 and 0 < self.beta2 < 1):
            raise ValueError("optim.beta1, optim.beta2: expected in [0, 1)")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay: expected >= 0, got {self.weight_decay}")


# Each optimizer's own values of the settings whose meaning it gives (`optim.* = "auto"`).
OWN_DEFAULTS = {"ivon": {"lr": 10.0, "beta2": 0.9999, "weight_decay": 1e-6},
                "adamw": {"lr": 1e-4, "beta2": 0.999, "weight_decay": 0.0}}


@dataclass(frozen=True)
class SyncConfig:
    """The sync budget (algorithms.md §3.7): when the learner publishes a new version."""

    kappa: float = 0.01
    """Publish when KL(behaviour ‖ current) (k3, per token, on the drift sample) exceeds κ: the
    behaviour has drifted from the current policy by as much as a slot's noise takes it from the mean
    (noise.target_kl's default). Measured (benchmarks/README.md, issue 38): on the embedded default the
    drift exceeds 0.01 on ~2% of steps and 0.05 on none; on SmolLM2 at the study's step sizes it is
    0.06-0.28 from the third step on."""
    eta: float = 0.9
    """Publish when the Kish ESS fraction of the sequence importance weights (on the drift sample)
    falls below η: a tenth of the batch's weight lost to the correction. Measured: below 0.9 on ~4% of
    the embedded default's steps (never below 0.5), 0.04-0.38 on SmolLM2's."""
    max_staleness: int = 4
    """Publish after this many learner steps without a publish (1 = every step): the bound for a
    policy that drifts slowly (the embedded default: most of its publishes)."""
    drift_rows: int | Literal["all"] = 8
    """Rollouts the drift diagnostic (κ, η) is measured on each step where it costs a no-grad forward
    of its own (a posterior, IVON: each rollout's slot rebuilt from the start-of-step posterior): a
    seeded sample of one slot's rows, the slot rotating with the step, in pairs of one prompt's
    rollouts (computed once); `all`: every rollout at its own slot. Without a posterior (AdamW) every
    rollout is measured, from the update's own forward."""

    def __post_init__(self) -> None:
        if self.kappa <= 0 or not 0 < self.eta <= 1 or self.max_staleness < 1:
            raise ValueError("sync.kappa > 0, sync.eta in (0, 1] and sync.max_staleness >= 1 expected")
        if self.drift_rows != "all" and self.drift_rows < 1:
            raise ValueError(f"sync.drift_rows: expected >= 1, or \"all\" (every rollout), got {self.drift_rows}")
