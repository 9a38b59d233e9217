"""How far a served slot's policy is from the mean's, and the σ scale that holds it at a target
(issue 25; algorithms.md §2.6).

A slot serves θ̂ = m + c · σ ⊙ z: IVON's σ gives the noise its shape, the scale c its size. For small
perturbations the divergence it causes is quadratic in c,

    KL(π_θ̂ ‖ π_m) ≈ ½ c² (σ ⊙ z)ᵀ F (σ ⊙ z)          (F: the Fisher information at m),

so a scale c whose slots measured KL = k reaches a target K at c' = c · sqrt(K / k). Plappert et al.
(2018) hold the distance between the perturbed and the clean policy at a target by multiplying or
dividing σ by α = 1.01 each step; PSN-RLVR holds the per-token KL of the noised model near 0.003–0.005
nats the same way. Here each version takes a share (the gain) of the step the quadratic law gives,
bounded by a factor `max_factor` per version: a version's measurement moves c at once where α = 1.01
would need hundreds of steps to move it tenfold, and a gain below 1 keeps a probe's sampling noise
from moving it as much.

Where the slots already served measured their KL (`feedback_scale`), each measurement (c_i, k_i)
implies the scale c_i · sqrt(K / k_i) by the same law whatever scale it was served at (a re-admitted
slot's multiplier included), and the next version's scale steps towards their median, the whole way
down and a share of the way up: feedback from the versions before, as PSN-RLVR's and Plappert et
al.'s controllers are.

Departures: the KL is the exact one over the vocabulary at the measured positions (both
log-softmaxes at the sampler's temperature), not a sampled-token estimate; the step is the quadratic
law's, not a fixed α.
"""

from __future__ import annotations

import math

import torch


def policy_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), p = softmax(logits_p / T), q likewise.

    Shapes: logits_p, logits_q [N, V] -> [N], fp32, ≥ 0 up to rounding."""
    assert logits_p.shape == logits_q.shape, (logits_p.shape, logits_q.shape)
    assert temperature > 0, f"temperature must be positive, got {temperature}"
    log_p = torch.log_softmax(logits_p.float() / temperature, dim=-1)
    log_q = torch.log_softmax(logits_q.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def next_noise_scale(scale: float, kl: float, target_kl: float, max_factor: float = 4.0, gain: float = 1.0) -> float:
    """c' = c · clip((K / k)^(g/2), 1/f, f): with gain g = 1 the scale whose slots would measure the
    target KL K, by the quadratic law (module docstring), from a scale c whose slots measured k; g < 1
    takes that share of the step in log c (a noisy measurement moves c less: log c then averages the
    measurements exponentially); f = `max_factor` bounds one step. A measured k of 0 (nothing changed
    the policy) takes the largest step up."""
    assert scale > 0 and target_kl > 0 and kl >= 0 and max_factor >= 1 and 0 < gain <= 1, (
        scale, kl, target_kl, max_factor, gain)
    ratio = (target_kl / kl) ** (gain / 2) if kl > 0 else max_factor
    return scale * min(max(ratio, 1.0 / max_factor), max_factor)


def feedback_scale(scale: float, measured: list[tuple[float, float]], target_kl: float, gain: float = 1.0,
                   max_factor: float = 4.0) -> float:
    """c' = c · (c̃ / c)^g, the next version's scale from slots already served: `measured` holds (c_i,
    k_i), a slot served at scale c_i whose rollouts measured a per-token KL k_i; each implies the scale
    c_i · sqrt(K / k_i) that would have reached the target K by the quadratic law, and c̃ is their
    median (a draw's KL is heavy-tailed in z: the median, not the mean). Downwards (c̃ < c: the slots
    measured over the target) the whole step, g = 1; upwards the share `gain` of it in log c: past a
    point a real policy's KL grows faster than c², so the quadratic law's step up overshoots and its
    step down lands below the target, on the safe side. f = `max_factor` bounds both a measurement's
    implied step (a k_i of 0 implies c_i · f) and the step itself. No measurement: c unchanged."""
    assert scale > 0 and target_kl > 0 and 0 < gain <= 1 and max_factor >= 1, (scale, target_kl, gain, max_factor)
    if not measured:
        return scale
    implied = sorted(math.log(next_noise_scale(c, k, target_kl, max_factor)) for c, k in measured)
    middle = len(implied) // 2
    log_target = implied[middle] if len(implied) % 2 else 0.5 * (implied[middle - 1] + implied[middle])
    error = log_target - math.log(scale)
    step = min(max(error * (gain if error > 0 else 1.0), -math.log(max_factor)), math.log(max_factor))
    return scale * math.exp(step)
