"""The sync budget: when the learner publishes a new policy version (algorithms.md §3.7,
architecture.md §2.4).

After every step the learner measures, on its latest batch, how far the behaviour policy μ (the
version the samplers serve) is from its current policy: the k3 KL estimate and the Kish ESS
fraction of the sequence importance weights (`off_policy.behaviour_drift`). Under parameter noise
"its current policy" is each rollout's own slot rebuilt from the current posterior, m + σ ⊙ z(seed):
against a fresh θ̂′ the measure would fire on the exploration noise between slots, which no publish
removes. It publishes when any of

    KL̂ > κ      ESS_frac < η      steps_since_sync ≥ S_max

holds; the reason is the first that fires in that order, so a dashboard can count sync events by
cause. On-policy 3PO is the special case S_max = 1 (publish after every step).

What this is not: the measurement (off_policy.py), the publishing (the learner), the admission
of stale rollouts (the driver). Departures: none from §3.7; the fixed reason order is ours.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

REASONS = ("kl", "ess", "staleness")


@dataclass(frozen=True)
class SyncDecision:
    """Whether to publish now, and why: `reason` ∈ {"kl", "ess", "staleness"} or None."""

    publish: bool
    reason: str | None

    def __post_init__(self) -> None:
        if self.publish != (self.reason is not None) or self.reason not in (*REASONS, None):
            raise ValueError(f"inconsistent SyncDecision(publish={self.publish}, reason={self.reason!r})")


def _is_count(value, low: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def sync_decision(*, kl: float, ess_frac: float, steps_since_sync: int, kappa: float, eta: float,
                  max_staleness: int) -> SyncDecision:
    """Publish iff KL̂ > κ (kl: the k3 estimate, ≥ 0), or ESS_frac < η, or steps_since_sync ≥ S_max
    (§3.7; checked in that order, the first that fires is the reason). §7 defaults: κ 0.02, η 0.5, S_max 8.

    Raises ValueError on a NaN or out-of-range argument, so a broken measurement cannot silently
    read as "no sync needed".
    """
    checks = [
        ("kl", kl, not math.isnan(kl) and kl >= -1e-12),  # k3 is ≥ 0 up to rounding
        ("ess_frac", ess_frac, not math.isnan(ess_frac) and 0.0 <= ess_frac <= 1.0 + 1e-9),
        ("steps_since_sync", steps_since_sync, _is_count(steps_since_sync, 0)),
        ("kappa", kappa, not math.isnan(kappa) and kappa >= 0.0),
        ("eta", eta, not math.isnan(eta) and 0.0 <= eta <= 1.0),
        ("max_staleness", max_staleness, _is_count(max_staleness, 1)),
    ]
    for name, value, ok in checks:
        if not ok:
            raise ValueError(f"sync_decision: invalid {name}={value!r}")
    if kl > kappa:
        return SyncDecision(True, "kl")
    if ess_frac < eta:
        return SyncDecision(True, "ess")
    if steps_since_sync >= max_staleness:
        return SyncDecision(True, "staleness")
    return SyncDecision(False, None)
