"""The IVON update of algorithms.md §1.2 as pure, elementwise tensor functions: Price's (or the
squared-gradient) Hessian estimate, the positivity-preserving Hessian EMA, the momentum, and the
clipped, preconditioned step of the mean. Derived from the paper's formulas (ivon-opt is GPL-3.0;
nothing here is copied from it). `algorithms/ivon.py`'s optimizer applies them a chunk at a time.
"""

from __future__ import annotations

import torch


def price_hessian_estimate(avg_nxg: torch.Tensor, hess: torch.Tensor, ess: float,
                           weight_decay: float) -> torch.Tensor:
    """ĥ = λ (h + δ) ⊙ mean_k(ε_k ⊙ ĝ_k)   (§1.2, 'price'; = ĝ ⊙ (θ̂ − m) / σ² by Price/Bonnet).

    Shapes: avg_nxg [*], hess [*] -> [*]. Often negative for a single sample; see `hessian_update`.
    """
    return (hess + weight_decay).mul_(avg_nxg).mul_(ess)


def gradsq_hessian_estimate(avg_gsq: torch.Tensor, ess: float) -> torch.Tensor:
    """ĥ = λ · mean_k(ĝ_k ⊙ ĝ_k)   (§1.2, hess_approx='gradsq'). Shapes: [*] -> [*], always ≥ 0."""
    return ess * avg_gsq


def hessian_update(hess: torch.Tensor, hess_est: torch.Tensor, beta2: float,
                   weight_decay: float) -> torch.Tensor:
    """h ← β2 h + (1 − β2) ĥ + ½ (1 − β2)² (h − ĥ)² / (h + δ)   (§1.2; old h on the right).

    Positivity: with a = 1 − β2, H = h + δ > 0, x = a (ĥ − h) / H the result satisfies
    h_new + δ = H (1 + (1 + x)²) / 2 ≥ H / 2 > 0 for ĥ of any sign or size.
    Shapes: hess [*], hess_est [*] -> [*].
    """
    a = 1.0 - beta2
    gap = hess - hess_est
    return torch.add(hess * beta2, hess_est, alpha=a).addcmul_(gap, gap / (hess + weight_decay), value=0.5 * a * a)


def momentum_update(momentum: torch.Tensor, grad: torch.Tensor, beta1: float) -> torch.Tensor:
    """g_m ← β1 g_m + (1 − β1) ḡ   (§1.2; ḡ the mean gradient over the K samples). [*] -> [*]."""
    return torch.add(momentum * beta1, grad, alpha=1.0 - beta1)


def mean_step(mean: torch.Tensor, momentum: torch.Tensor, hess: torch.Tensor, *, lr: float,
              step: int, beta1: float, weight_decay: float, hess_init: float, clip_radius: float,
              rescale_lr: bool, debias: bool) -> torch.Tensor:
    """m ← m − α · clip((g_m / b + δ m) / (h + δ), −ξ, ξ)   (§1.2; g_m and h already updated).

    α = lr (h0 + δ) if rescale_lr else lr;  b = 1 − β1^t if debias else 1;  t = `step` ≥ 1.
    Shapes: mean, momentum, hess [*] -> new mean [*].
    """
    assert step >= 1, f"step counts from 1 after the first update, got {step}"
    alpha = lr * (hess_init + weight_decay) if rescale_lr else lr
    debias_b = 1.0 - beta1**step if debias else 1.0
    direction = torch.add(momentum / debias_b, mean, alpha=weight_decay).div_(hess + weight_decay)
    return torch.add(mean, direction.clamp_(-clip_radius, clip_radius), alpha=-alpha)
