"""VP2O's anchor prototype budget (algorithms.md §3.7), and the map of VP2O's pieces.

VP2O (algorithms.md §3) treats the experts of each MoE layer as SVGD particles. Its implementation
details, in the order of one optimizer step (§3.8), and where each lives:
1. Prototypes p_e = u_1(W_out[e]) by warm-started power iteration on fused down_proj [E, H, I],
   differentiable through a stop-grad surrogate ............... svgd.prototypes (§3.2)
2. Angular kernel k_ij = exp(−(1 − ⟨p_i,p_j⟩²)/h), median bandwidth svgd.angular_kernel (§3.3)
3. Co-activation load f, rates C from router top-k, EMA, lift-based attraction / repulsion sets
   (inactive experts repelled by all) ....... moe.coactivation_stats / update_coactivation_ema /
   coactivation_sets (§3.4)
4. Attraction: each expert's gradient replaced by a kernel-weighted average over A(i) ∪ {i},
   applied to every fused expert tensor ....................... svgd.attract_expert_grads (§3.5)
5. Repulsion: γ_rep·∇L_rep added to down_proj's grad by a separate small backward
   ............................................................ svgd.repulsion_energy (§3.5)
6. L_orth on unweighted expert outputs, L_div on router probabilities, added to the main loss
   ....... moe.expert_outputs / expert_orthogonality_loss / routing_diversification_loss (§3.6)
7. Anchor prototype budget: after the optimizer step, shrink each expert's step so its prototype
   drift from the anchor stays ≤ B_anc ......... anchor_drift, shrink_to_anchor_budget (§3.7)
8. Event-driven behaviour sync on KL / ESS / staleness ........... sync_budget.py (§3.7)

Not here: the optimizer, the all-reduce of gradients, snapshotting anchors at sync events (the
learner does those).

Readings of the spec: the bisection keeps the largest tested s that meets the budget (lower end
of the bracket), so after n steps s ∈ {0, 1/2ⁿ, …, 1 − 1/2ⁿ} for a clamped expert; s = 0 returns
θ_prev, which meets the budget whenever the previous step did. The prototype used for the drift is
re-estimated from the candidate weights with the warm state v held fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from threepo.algorithms.svgd import prototypes


def anchor_drift(p: torch.Tensor, p_anchor: torch.Tensor) -> torch.Tensor:
    """Angular drift from the anchor snapshot, algorithms.md §3.7:

        Δ_e = 1 − ⟨p_e, p_e^anc⟩²   (= sin² of the angle; sign-invariant)
    Args: p [E, H], p_anchor [E, H] unit prototypes. Returns Δ [E] in [0, 1].
    """
    if p.shape != p_anchor.shape or p.dim() != 2:
        raise ValueError(f"p/p_anchor: expected equal shapes [E, H], got {tuple(p.shape)} and {tuple(p_anchor.shape)}")
    cos = (p * p_anchor.to(p.dtype)).sum(dim=1)
    return (1.0 - cos.square()).clamp(0.0, 1.0)


def prototype_drift_fn(
    p_anchor: torch.Tensor, v: torch.Tensor, *, down_index: int = 0, n_iter: int = 2
) -> Callable[[Sequence[torch.Tensor]], torch.Tensor]:
    """The drift measure of §3.7 as a function of a layer's expert blocks, for
    `shrink_to_anchor_budget`:  blocks ↦ anchor_drift(prototypes(blocks[down_index], v), p_anchor).

    Args: p_anchor [E, H] anchor prototypes; v [E, I] current power-iteration warm state (held
    fixed); down_index = position of the fused down_proj [E, H, I] among the blocks; n_iter.
    Returns a callable mapping a sequence of [E, ...] blocks to Δ [E].
    """

    def drift(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            p, _ = prototypes(blocks[down_index], v, n_iter=n_iter)
            return anchor_drift(p, p_anchor)

    return drift


def _interpolate(prev: Sequence[torch.Tensor], new: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for a, b in zip(prev, new):
        s = scale.to(a.device).reshape(-1, *([1] * (a.dim() - 1)))
        # s = 1 and s = 0 must give θ_new / θ_prev bit-exactly, also in bf16
        mixed = a + s.to(a.dtype) * (b - a)
        out.append(torch.where(s == 1, b, torch.where(s == 0, a, mixed)))
    return out


def shrink_to_anchor_budget(
    theta_prev: Sequence[torch.Tensor],
    theta_new: Sequence[torch.Tensor],
    drift_fn: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    budget: float = math.sin(0.05) ** 2,
    *,
    n_bisect: int = 3,
) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """Anchor prototype budget by per-expert step shrinking, algorithms.md §3.7:

        if Δ_e(θ_new) > B_anc:  θ_e ← θ_e^prev + s_e (θ_e^new − θ_e^prev),
        s_e ∈ [0, 1] by `n_bisect` bisection steps on Δ_e(θ(s)) ≤ B_anc;  s_e = 1 otherwise.

    All experts are bisected together, one `drift_fn` call per step (n_bisect + 1 calls in all).
    Pure: returns new tensors; the caller copies them into the parameters and leaves the
    optimizer state untouched.
    Args: theta_prev, theta_new: matching sequences of per-layer expert blocks, each [E, ...]
    (e.g. (gate_up_proj, down_proj) before and after the step); drift_fn: blocks -> Δ [E]
    (e.g. `prototype_drift_fn`); budget B_anc (default sin²(0.05 rad) ≈ 2.5e-3); n_bisect ≥ 0.
    Returns (blocks, scale s [E], fraction of clamped experts as float).
    """
    if len(theta_prev) != len(theta_new) or not theta_prev:
        raise ValueError(f"theta_prev/theta_new: expected equal non-zero lengths, got {len(theta_prev)} and {len(theta_new)}")
    n_exp = theta_prev[0].shape[0]
    for a, b in zip(theta_prev, theta_new):
        if a.shape != b.shape or a.shape[0] != n_exp:
            raise ValueError(f"theta_prev/theta_new: expected matching [E={n_exp}, ...] blocks, got {tuple(a.shape)} and {tuple(b.shape)}")
    theta_new = [b.detach() for b in theta_new]
    theta_prev = [a.detach() for a in theta_prev]
    clamped = drift_fn(theta_new) > budget  # [E]
    if not bool(clamped.any()):
        return list(theta_new), torch.ones(n_exp, dtype=torch.float64), 0.0
    clamped = clamped.cpu()
    lo = torch.zeros(n_exp, dtype=torch.float64)
    hi = torch.ones(n_exp, dtype=torch.float64)
    for _ in range(n_bisect):
        mid = torch.where(clamped, (lo + hi) / 2, hi)
        ok = (drift_fn(_interpolate(theta_prev, theta_new, mid)) <= budget).cpu()
        lo = torch.where(clamped & ok, mid, lo)
        hi = torch.where(clamped & ~ok, mid, hi)
    scale = torch.where(clamped, lo, hi)
    return _interpolate(theta_prev, theta_new, scale), scale, float(clamped.double().mean())
