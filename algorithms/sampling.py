"""The sampling distribution of one decoding step: temperature, top-k and top-p (nucleus) filtering.

The behaviour log-probs an engine reports are log-probs of *this* distribution (after temperature and
filtering), so that the learner's importance weights compare like with like (algorithms.md §0.5).
Not here: the decoding loop and KV cache (services/engines/hf.py).
"""

from __future__ import annotations

import torch


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


def sample_from_logprobs(logp: torch.Tensor, generator: torch.Generator | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row: v ~ exp(logp). Shapes: logp [B, V] -> (tokens [B], logp of them [B])."""
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
