"""The sampling distribution of one decoding step: temperature, top-k and top-p (nucleus) filtering.

The behaviour log-probs an engine reports are log-probs of *this* distribution (after temperature and
filtering), so that the learner's importance weights compare like with like (algorithms.md §0.5).
Per-request seeds: `row_uniforms` is a counter-based stream (splitmix64 of seed and step), so the
draw of one row depends only on its own seed and position — not on which other requests share the
batch, nor on anything sampled before. Not here: the decoding loop and KV cache
(services/sampling/engines/hf.py).
"""

from __future__ import annotations

import numpy as np
import torch

from threepo.algorithms.counter_normal import GOLDEN, splitmix64


def sampling_logprobs(logits: torch.Tensor, *, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """Log-probs of the filtered sampling distribution.

    log π(v) = log softmax(z / T)(v) restricted to the kept set and renormalised, where the kept set
    is the top-k logits (k = 0: all) intersected with the smallest prefix of the sorted distribution
    whose mass reaches p (the token that crosses p is kept). Removed tokens get −inf.
    Shapes: logits [..., V] -> [..., V], fp32.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    z = logits.float() / temperature
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # mass strictly before each token; a token is kept while that mass is below p
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)




def row_uniforms(seeds: np.ndarray, step: int) -> torch.Tensor:
    """u_b = splitmix64(seed_b + (step + 1)·γ) / 2^64 ∈ [0, 1), one per row (uint64 arithmetic wraps,
    which is the point). Shapes: seeds [B] (any integer dtype; reduced mod 2^64) -> [B] fp64."""
    with np.errstate(over="ignore"):
        x = splitmix64(np.asarray(seeds).astype(np.uint64) + np.uint64(step + 1) * GOLDEN)
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def sample_with_uniforms(logp: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per row: the first v with CDF(v) > u · CDF(V), in fp64. Tokens of zero
    probability (filtered to −inf) are never drawn: the CDF is flat across them.
    Shapes: logp [B, V], u [B] -> (tokens [B], logp of them [B])."""
    cdf = logp.double().exp().cumsum(-1)
    target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
