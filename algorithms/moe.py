"""MoE routing statistics and VP2O's specialisation losses (algorithms.md §3.4, §3.6).

Works on what a transformers MoE layer produces: router top-k indices [T, K] over the flattened
tokens, router probabilities [T, E] (softmax of the router logits over all E experts), and the
fused expert weights `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I].

Not here: prototypes, kernel and the Stein transport (svgd.py), the anchor budget (vp2o.py).

Readings of the spec:
- The EMA (`update_coactivation_ema`) starts from the first step's statistics (no zero init, so
  no bias correction is needed); f̂ follows the same EMA as Ĉ, which §3.4 implies by using f̂.
- Var_t in L_div is the population variance over valid tokens (§3.6 does not say which).
- `expert_outputs` recomputes the unweighted expert outputs y_{t,e} for L_orth, because the
  transformers forward only returns their gate-weighted sum; it adds one expert pass per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _token_weights(n_tok: int, mask: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if mask is None:
        return torch.ones(n_tok, device=device, dtype=dtype)
    if mask.shape != (n_tok,):
        raise ValueError(f"mask: expected shape [{n_tok}], got {tuple(mask.shape)}")
    weights = mask.to(device=device, dtype=dtype)
    if not bool(weights.sum() > 0):
        raise ValueError("mask: selects no tokens; statistics over an empty set are undefined")
    return weights


def coactivation_stats(
    topk_idx: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert load and co-activation rates of one mini-batch, algorithms.md §3.4:

        f_i = (1/T) Σ_t 1[i ∈ S_t],   C_ij = (1/T) Σ_t 1[i ∈ S_t ∧ j ∈ S_t]   (C_ii = f_i)

    over the valid tokens t (T = their number). Args: topk_idx [T, K] int router choices S_t;
    num_experts E; mask [T] bool/0-1 of valid tokens or None (all). Returns (f [E], C [E, E]) fp32.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected shape [T, K], got {tuple(topk_idx.shape)}")
    if topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= num_experts):
        raise ValueError(f"topk_idx: expected expert ids in [0, {num_experts}), got {topk_idx.min()}..{topk_idx.max()}")
    n_tok = topk_idx.shape[0]
    weights = _token_weights(n_tok, mask, topk_idx.device, torch.float32)
    member = torch.zeros(n_tok, num_experts, device=topk_idx.device, dtype=torch.float32)
    member.scatter_(1, topk_idx.long(), 1.0)  # set membership: a repeated id still counts once
    weighted = member * weights[:, None]
    total = weights.sum()
    return weighted.sum(dim=0) / total, weighted.T @ member / total


def update_coactivation_ema(
    prev_f: torch.Tensor | None, prev_c: torch.Tensor | None, f: torch.Tensor, c: torch.Tensor, beta: float = 0.9
) -> tuple[torch.Tensor, torch.Tensor]:
    """EMA across steps, algorithms.md §3.4:  f̂ ← β f̂ + (1 − β) f,  Ĉ ← β Ĉ + (1 − β) C.

    Args: previous (f̂ [E], Ĉ [E, E]) or (None, None) on the first step, which returns (f, C);
    current (f, C) from `coactivation_stats`; 0 ≤ beta < 1. Returns new (f̂ [E], Ĉ [E, E]).
    """
    if (prev_f is None) != (prev_c is None):
        raise ValueError("prev_f/prev_c: expected both or neither to be None")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta: expected in [0, 1), got {beta}")
    if prev_f is None:
        return f.clone(), c.clone()
    if prev_f.shape != f.shape or prev_c.shape != c.shape:
        raise ValueError(f"prev_f/prev_c: shapes {tuple(prev_f.shape)}/{tuple(prev_c.shape)} differ from f/C")
    return beta * prev_f + (1.0 - beta) * f, beta * prev_c + (1.0 - beta) * c


def chance_lift(n_experts: int, top_k: int) -> float:
    """Co-activation lift of a router choosing its top-k sets uniformly at random [OURS]:

        f = K/E,  C_ij = K(K−1) / (E(E−1))   ⇒   λ₀ = C_ij / f² = E(K−1) / (K(E−1))
    It is below 1 for every K < E (a top-k router cannot pick an expert twice, so two given experts
    co-occur less often than independence would say), and the largest lift any pair can have is
    E/K. Top-1 routing never co-activates two experts: λ₀ = 0.
    """
    if not 1 <= top_k <= n_experts or n_experts < 2:
        raise ValueError(f"top_k: expected 1 <= top_k <= n_experts (>= 2), got {top_k} of {n_experts}")
    return n_experts * (top_k - 1) / (top_k * (n_experts - 1))


def coactivation_sets(
    f_hat: torch.Tensor, c_hat: torch.Tensor, *, lift_hi: float = 2.0, lift_lo: float = 0.5, top_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attraction and repulsion sets from co-activation lift, algorithms.md §3.4:

        lift_ij = Ĉ_ij / (f̂_i f̂_j + 1e-12)            (÷ chance_lift(E, K) when top_k = K is given)
        A(i) = {j ≠ i : lift_ij ≥ ℓ_hi},   R(i) = {j ≠ i : lift_ij ≤ ℓ_lo}
    Inactive experts (f̂_i = 0) are in every R(j) and R(i) holds every j. With `top_k`, thresholds
    are relative to a uniform top-k router (§3.4's ℓ_hi = 2 is then "twice as often as chance"):
    the raw lift of a top-K-of-E router is at most E/K, e.g. 2 for top-2 of 4, so an absolute
    ℓ_hi = 2 attracts nothing there [departure from §3.4, OURS]. With top-1 nothing co-activates:
    A is empty and every pair repels.
    Args: f_hat [E], c_hat [E, E]. Returns (attract [E, E] bool, repel [E, E] bool), row i = set of i,
    diagonals False; pairs with ℓ_lo < lift < ℓ_hi are in neither.
    """
    n_exp = f_hat.shape[0]
    if c_hat.shape != (n_exp, n_exp):
        raise ValueError(f"c_hat: expected shape [{n_exp}, {n_exp}], got {tuple(c_hat.shape)}")
    if not lift_lo < lift_hi:
        raise ValueError(f"lift_lo/lift_hi: expected lift_lo < lift_hi, got {lift_lo} and {lift_hi}")
    off_diag = ~torch.eye(n_exp, dtype=torch.bool, device=f_hat.device)
    lift = c_hat / (f_hat[:, None] * f_hat[None, :] + 1e-12)
    if top_k is not None:
        chance = chance_lift(n_exp, top_k)
        lift = lift / chance if chance else torch.zeros_like(lift)
    inactive = f_hat == 0
    attract = (lift >= lift_hi) & off_diag & ~inactive[:, None] & ~inactive[None, :]
    repel = ((lift <= lift_lo) | inactive[:, None] | inactive[None, :]) & off_diag
    return attract, repel


def expert_outputs(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """Unweighted outputs of each token's selected experts (input to L_orth, §3.6):

        y_{t,k} = W_down[e] (act(W_gate[e] x_t) ⊙ W_up[e] x_t),   e = topk_idx[t, k]
    with [W_gate; W_up] = gate_up_proj[e] split in halves along dim 1 (transformers' gated layout).
    Args: hidden [T, H] layer input; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_idx [T, K].
    Returns [T, K, H], differentiable in hidden and both weights.
    """
    n_tok, hid = hidden.shape
    n_exp = gate_up_proj.shape[0]
    if gate_up_proj.shape[2] != hid or down_proj.shape[:2] != (n_exp, hid):
        raise ValueError(
            f"gate_up_proj/down_proj: expected [E, 2I, {hid}] and [E, {hid}, I], "
            f"got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != n_tok:
        raise ValueError(f"topk_idx: expected shape [{n_tok}, K], got {tuple(topk_idx.shape)}")
    out = hidden.new_zeros(n_tok, topk_idx.shape[1], hid)
    for e in torch.unique(topk_idx).tolist():
        tok, slot = torch.where(topk_idx == e)
        gate, up = F.linear(hidden[tok], gate_up_proj[e]).chunk(2, dim=-1)
        out = out.index_put((tok, slot), F.linear(act_fn(gate) * up, down_proj[e]))
    return out


def expert_orthogonality_loss(expert_out: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Expert orthogonalisation loss, algorithms.md §3.6:

        L_orth = 1/(T·K(K−1)) Σ_t Σ_{i≠j ∈ S_t} ( ⟨y_{t,i}, y_{t,j}⟩ / (‖y_{t,i}‖ ‖y_{t,j}‖ + 1e-6) )²
    0 for mutually orthogonal outputs, ≈ 1 for parallel ones.
    Args: expert_out [T, K, H] unweighted outputs (`expert_outputs`); mask [T] valid tokens or None.
    Returns a scalar (0 when K < 2).
    """
    if expert_out.dim() != 3:
        raise ValueError(f"expert_out: expected shape [T, K, H], got {tuple(expert_out.shape)}")
    n_tok, k, _ = expert_out.shape
    if k < 2:
        return (expert_out * 0.0).sum()
    weights = _token_weights(n_tok, mask, expert_out.device, expert_out.dtype)
    norms = expert_out.norm(dim=2)  # [T, K]
    gram = expert_out @ expert_out.transpose(1, 2)  # [T, K, K]
    cos_sq = (gram / (norms[:, :, None] * norms[:, None, :] + 1e-6)).square()
    off_diag = 1.0 - torch.eye(k, dtype=expert_out.dtype, device=expert_out.device)
    per_token = (cos_sq * off_diag).sum(dim=(1, 2))
    return (per_token * weights).sum() / (weights.sum() * k * (k - 1))


def routing_diversification_loss(router_probs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Routing diversification loss, algorithms.md §3.6:  L_div = −(1/E) Σ_e Var_t(π_{t,e}),

    Var_t the population variance over valid tokens; descent makes routing token-discriminative.
    Args: router_probs [T, E] (softmax over all E before top-k); mask [T] or None.
    Returns a scalar ≤ 0.
    """
    if router_probs.dim() != 2:
        raise ValueError(f"router_probs: expected shape [T, E], got {tuple(router_probs.shape)}")
    weights = _token_weights(router_probs.shape[0], mask, router_probs.device, router_probs.dtype)
    weights = weights / weights.sum()
    mean = (weights[:, None] * router_probs).sum(dim=0)
    var = (weights[:, None] * (router_probs - mean).square()).sum(dim=0)
    return -var.mean()
