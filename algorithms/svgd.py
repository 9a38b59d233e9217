"""VP2O's Stein transport over the experts of one MoE layer: prototypes, angular kernel,
attraction (kernel-weighted gradient sharing) and repulsion energy (algorithms.md §3.2, §3.3, §3.5).

The particles are the E experts of a layer, held in transformers' FUSED layout: `down_proj` is
[E, H, I] (expert e's output projection W_out = down_proj[e] ∈ R^{H×I}) and `gate_up_proj` is
[E, 2I, H]. A prototype is the top left singular vector of W_out, a unit vector in the residual
stream R^H; the kernel compares prototypes by their squared cosine, so the sign ambiguity of
singular vectors does not matter.

Not here: co-activation statistics and the specialisation losses (moe.py), the anchor budget
(vp2o.py), the optimizer step and any collective (the learner all-reduces gradients first).

Departures from / readings of the spec:
- `median_bandwidth` uses the interpolated median (`torch.quantile(·, 0.5)`); for an even number
  of pairs torch.median would return the lower of the two middle values.
- With E = 1 there are no pairs; the bandwidth is then h_min (it multiplies nothing).
- `repulsion_energy` takes the unordered pairs {i, j} with j ∈ R(i) or i ∈ R(j); the sets built by
  moe.coactivation_sets are symmetric, where this equals §3.5's P_R = {(i,j): i<j, j ∈ R(i)}.
"""

from __future__ import annotations

import math

import torch


def _unit(x: torch.Tensor, dim: int) -> torch.Tensor:
    # a dead (all-zero) expert keeps a zero vector instead of NaN
    return x / x.norm(dim=dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def prototypes(
    down_proj: torch.Tensor,
    v_prev: torch.Tensor | None,
    *,
    n_iter: int = 2,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert prototypes by warm-started power iteration, algorithms.md §3.2.

        repeat n_iter:  u ← W v / ‖W v‖;  v ← Wᵀ u / ‖Wᵀ u‖        (no grad)
        p = W v̄ / ‖W v̄‖,  v̄ = stopgrad(v)                           (differentiable in W)

    for every expert's W = down_proj[e] ∈ R^{H×I}; p → u_1(W) (top left singular vector).
    Computed in fp32 (fp64 if down_proj is fp64).
    Args: down_proj [E, H, I]; v_prev [E, I] warm state from the previous step, or None for a
    random unit start drawn from `generator` (required then); n_iter ≥ 0.
    Returns (p [E, H] unit rows, carrying grad to down_proj; v [E, I] detached new warm state).
    """
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj: expected fused shape [E, H, I], got {tuple(down_proj.shape)}")
    n_exp, _, inter = down_proj.shape
    dtype = torch.promote_types(down_proj.dtype, torch.float32)
    w = down_proj.to(dtype)
    if v_prev is None:
        if generator is None:
            raise ValueError("generator: needed for the random start when v_prev is None")
        v = torch.randn(n_exp, inter, generator=generator, device=generator.device, dtype=dtype)
        v = v.to(down_proj.device)
    else:
        if v_prev.shape != (n_exp, inter):
            raise ValueError(f"v_prev: expected shape {(n_exp, inter)}, got {tuple(v_prev.shape)}")
        v = v_prev.detach().to(device=down_proj.device, dtype=dtype)
    with torch.no_grad():
        wd = w.detach()
        v = _unit(v, dim=1)
        for _ in range(n_iter):
            u = _unit(torch.bmm(wd, v.unsqueeze(2)).squeeze(2), dim=1)  # [E, H]
            v = _unit(torch.bmm(wd.transpose(1, 2), u.unsqueeze(2)).squeeze(2), dim=1)  # [E, I]
    p = _unit(torch.bmm(w, v.unsqueeze(2)).squeeze(2), dim=1)
    return p, v


def median_bandwidth(p: torch.Tensor, *, h_min: float = 1e-4) -> float:
    """Kernel bandwidth, algorithms.md §3.3:  h = max(median_{i<j}(1 − c_ij) / log(E + 1), h_min),
    c_ij = ⟨p_i, p_j⟩². Treated as a constant (returned as a float, no grad).
    Args: p [E, H] unit prototypes. Returns h > 0.
    """
    n_exp = p.shape[0]
    if n_exp < 2:
        return float(h_min)
    with torch.no_grad():
        dist = 1.0 - (p @ p.T).square()
        iu = torch.triu_indices(n_exp, n_exp, offset=1, device=p.device)
        med = torch.quantile(dist[iu[0], iu[1]].float(), 0.5).item()
    return max(med / math.log(n_exp + 1), float(h_min))


def kernel_matrix(p: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """Angular kernel at a fixed bandwidth, algorithms.md §3.3:

        k_ij = exp(−(1 − ⟨p_i, p_j⟩²) / h),   k_ii = 1 exactly.
    Args: p [E, H] unit prototypes (grad flows), bandwidth h > 0. Returns K [E, E], symmetric.
    """
    if p.dim() != 2:
        raise ValueError(f"p: expected shape [E, H], got {tuple(p.shape)}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth: expected > 0, got {bandwidth}")
    off_diag = 1.0 - torch.eye(p.shape[0], dtype=p.dtype, device=p.device)
    # masking instead of relying on ‖p‖ = 1 makes k_ii exactly 1 and gives it no gradient
    dist = (1.0 - (p @ p.T).square()).clamp_min(0.0) * off_diag
    return torch.exp(-dist / bandwidth)


def angular_kernel(p: torch.Tensor, *, h_min: float = 1e-4) -> tuple[torch.Tensor, float]:
    """Angular kernel with median bandwidth, algorithms.md §3.3 (`median_bandwidth`, `kernel_matrix`).

    Args: p [E, H] unit prototypes. Returns (K [E, E] with grad through p, bandwidth h as float).
    """
    bandwidth = median_bandwidth(p, h_min=h_min)
    return kernel_matrix(p, bandwidth), bandwidth


def attract_expert_grads(
    grads: torch.Tensor, kernel: torch.Tensor, attract: torch.Tensor, *, alpha_att: float = 1.0
) -> torch.Tensor:
    """Attraction / gradient sharing between co-activated experts, algorithms.md §3.5:

        G̃_i = (1 − α) G_i + α · Σ_{j ∈ A(i)∪{i}} k_ij G_j / Σ_{j ∈ A(i)∪{i}} k_ij,   k_ii = 1

    Apply the same K and A to every fused tensor of the layer (down_proj and gate_up_proj grads).
    An expert that got no tokens has a zero gradient row and receives only its neighbours' share.
    Args: grads [E, ...] (e.g. down_proj.grad [E, H, I]); kernel [E, E] (detached here);
    attract [E, E] bool, A(i) = row i (diagonal ignored); 0 ≤ alpha_att ≤ 1.
    Returns a new tensor shaped and typed like grads (inputs are not modified).
    """
    n_exp = grads.shape[0]
    if kernel.shape != (n_exp, n_exp) or attract.shape != (n_exp, n_exp):
        raise ValueError(
            f"kernel/attract: expected [{n_exp}, {n_exp}] for grads {tuple(grads.shape)}, "
            f"got {tuple(kernel.shape)} and {tuple(attract.shape)}"
        )
    if not 0.0 <= alpha_att <= 1.0:
        raise ValueError(f"alpha_att: expected in [0, 1], got {alpha_att}")
    dtype = torch.promote_types(grads.dtype, torch.float32)
    eye = torch.eye(n_exp, dtype=torch.bool, device=grads.device)
    weight = kernel.detach().to(dtype) * (attract.to(grads.device) | eye)
    weight = torch.where(eye, torch.ones_like(weight), weight)
    weight = weight / weight.sum(dim=1, keepdim=True)
    flat = grads.detach().reshape(n_exp, -1).to(dtype)
    mixed = (1.0 - alpha_att) * flat + alpha_att * (weight @ flat)
    return mixed.reshape(grads.shape).to(grads.dtype)


def repulsion_energy(p: torch.Tensor, bandwidth: float, repel: torch.Tensor) -> torch.Tensor:
    """Repulsion energy between rarely co-activated experts, algorithms.md §3.5:

        L_rep = (1/|P_R|) Σ_{(i,j) ∈ P_R} k(p_i, p_j),   P_R = {(i, j): i < j, j ∈ R(i)}

    Gradient descent on L_rep lowers the kernel, i.e. moves the prototypes apart; backpropagated
    through `prototypes` it reaches only down_proj. Scale by γ_rep before backward.
    Args: p [E, H] prototypes with grad; bandwidth h (constant, e.g. from `angular_kernel`);
    repel [E, E] bool. Returns a scalar; 0 (still attached to p) when P_R is empty.
    """
    n_exp = p.shape[0]
    if repel.shape != (n_exp, n_exp):
        raise ValueError(f"repel: expected shape [{n_exp}, {n_exp}], got {tuple(repel.shape)}")
    repel = repel.to(p.device)
    pairs = torch.triu(repel | repel.T, diagonal=1)
    if not bool(pairs.any()):
        return (p * 0.0).sum()
    return kernel_matrix(p, bandwidth)[pairs].mean()
