"""Importance weights and diagnostics for the sampler–learner mismatch (algorithms.md §5.6, §5.7).

What this is: truncated IS weights at token level (w_t = min(ρ_t, C)) and sequence level
(w_i = min(Π_t ρ_t, C)); their masked (rejection) variants, which drop tokens or sequences with
ρ > C from the loss mask and so from the loss denominator; the Kish effective-sample-size fraction;
k1/k3 KL estimates; and the per-step diagnostics dict (verl `compute_offpolicy_metrics`).
Throughout, ℓ = logp − logp_behav per token, where logp is the learner's (π_old in decoupled mode,
π_θ in bypass mode) and logp_behav the sampler's; ρ = e^ℓ. Every ratio is formed in log space,
clamped to ±20 before exponentiation, detached, and zero on padding.

What this is not: the loss (losses.py multiplies or masks with these), the sync decision
(sync_budget.py consumes `behaviour_drift`), anything with a gradient.
Departures: none from §5.6/§5.7; optional batch-normalisation of weights to mean 1 and the Geo-RS /
K3-RS rejection rules of §5.6 are not implemented.
"""

from __future__ import annotations

import math

import torch

LOG_RATIO_CLAMP = 20.0


def _token_log_ratio(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ℓ = logp − logp_behav, detached, 0 on padding. [B, T] -> [B, T] (not yet clamped)."""
    assert logp.dim() == 2 and logp.shape == logp_behav.shape == mask.shape, (logp.shape, mask.shape)
    log_ratio = (logp - logp_behav).detach()
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def _seq_log_ratio(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t M ℓ_t, clamped to ±20: [B, T] -> [B]."""
    log_ratio = _token_log_ratio(logp, logp_behav, mask).sum(dim=1)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")


def token_is_weights(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                     cap: float) -> torch.Tensor:
    """Token-TIS (§5.6): w_t = min(exp(clamp(ℓ_t, ±20)), C), 0 on padding. [B, T] -> [B, T]."""
    _check_cap(cap)
    log_ratio = _token_log_ratio(logp, logp_behav, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap) * mask.to(log_ratio.dtype)


def seq_is_weights(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                   cap: float) -> torch.Tensor:
    """Seq-TIS (§5.6): w_i = min(exp(clamp(Σ_t M ℓ_t, ±20)), C). [B, T] -> [B]; broadcast it over
    the sequence's tokens (w[:, None]) to weight a per-token loss."""
    _check_cap(cap)
    return torch.exp(_seq_log_ratio(logp, logp_behav, mask)).clamp(max=cap)


def token_mis_weights(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                      cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level masked IS (rejection, §5.6): keep_t = M_t ∧ (ρ_t ≤ C); w_t = ρ_t · keep_t.

    Returns (w [B, T], keep [B, T] bool): aggregate the loss with `keep` as its mask, so rejected
    tokens leave the denominator too (slime PR #657).
    """
    _check_cap(cap)
    log_ratio = _token_log_ratio(logp, logp_behav, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    keep = mask.bool() & (ratio <= cap)
    return torch.where(keep, ratio, torch.zeros_like(ratio)), keep


def seq_mis_weights(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                    cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Seq-MIS (§5.6): sequence IS weight w_i = Π_t ρ_t, sequences with w_i > C rejected.

    Returns (w [B] with 0 for rejected sequences, keep [B, T] bool = M ∧ (w_i ≤ C) broadcast):
    aggregate the loss with `keep`, which removes rejected sequences from the denominator.
    """
    _check_cap(cap)
    ratio = torch.exp(_seq_log_ratio(logp, logp_behav, mask))
    keep_seq = ratio <= cap
    return torch.where(keep_seq, ratio, torch.zeros_like(ratio)), mask.bool() & keep_seq[:, None]


def correction_weights(kind: str, logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                       cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights [B, T] of correction `kind` and the mask to aggregate the loss with (§5.6):

        none       w_t = M_t                       token_tis  w_t = min(ρ_t, C)
        seq_tis    w_t = min(Π_s ρ_s, C) · M_t     seq_mis    w_t = Π_s ρ_s · keep, keep = M ∧ (Π_s ρ_s ≤ C)
        token_mis  w_t = ρ_t · keep_t, keep_t = M_t ∧ (ρ_t ≤ C)

    The two MIS kinds change the mask (rejected sequences or tokens leave the loss denominator)."""
    match kind:
        case "none":
            return mask.to(logp.dtype), mask
        case "token_tis":
            return token_is_weights(logp, logp_behav, mask, cap=cap), mask
        case "seq_tis":
            return seq_is_weights(logp, logp_behav, mask, cap=cap)[:, None] * mask, mask
        case "seq_mis":
            w, keep = seq_mis_weights(logp, logp_behav, mask, cap=cap)
            keep_tok = mask * keep.to(mask.dtype)
            return w[:, None] * keep_tok, keep_tok
        case "token_mis":
            w, keep = token_mis_weights(logp, logp_behav, mask, cap=cap)
            return w, keep.to(mask.dtype)
    raise ValueError(f"kind must be one of none, token_tis, seq_tis, seq_mis, token_mis, got {kind!r}")


def capped_fraction(kind: str, logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                    cap: float) -> torch.Tensor:
    """Share of what correction `kind` caps or rejects, the weights' clip fraction: valid tokens with
    ρ_t > C (token_tis, token_mis) or sequences with Π_s ρ_s > C (seq_tis, seq_mis; sequences with a
    valid token); 0 for none. A scalar tensor."""
    if kind == "none":
        return torch.zeros((), dtype=logp.dtype, device=logp.device)
    if kind.startswith("token"):
        over = _token_log_ratio(logp, logp_behav, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) > math.log(cap)
        return (over & mask.bool()).sum() / mask.sum().clamp(min=1)
    valid = mask.sum(dim=1) > 0
    over = _seq_log_ratio(logp, logp_behav, mask) > math.log(cap)
    return (over & valid).sum() / valid.sum().clamp(min=1)


def kish_ess_fraction(log_w: torch.Tensor) -> torch.Tensor:
    """Kish ESS / N of weights w_i = e^{ℓ_i} (§5.7): (Σ w)² / (N Σ w²), in log space as

        exp(2·LSE(ℓ) − LSE(2ℓ) − log N)  ∈ (0, 1]     (1 iff all weights are equal)

    Shapes: log_w [N] (e.g. sequence log-ratios of the valid sequences) -> 0-dim, detached.
    """
    assert log_w.dim() == 1 and log_w.numel() > 0, f"log_w must be a non-empty [N], got {tuple(log_w.shape)}"
    log_w = log_w.detach()
    log_ess = 2.0 * torch.logsumexp(log_w, 0) - torch.logsumexp(2.0 * log_w, 0) - math.log(log_w.numel())
    return torch.exp(log_ess).clamp(max=1.0)  # rounding can exceed 1 by an ulp when all ℓ are equal


def kl_k1(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k1 estimate of KL(μ ‖ π) from tokens sampled by μ (§5.7 `kl`): mean_valid(logp_behav − logp).
    Shapes: [B, T] -> 0-dim, detached. Unbiased but can be negative."""
    log_ratio = _token_log_ratio(logp, logp_behav, mask)
    return -log_ratio.sum() / mask.sum().clamp_min(1)


def kl_k3(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(μ ‖ π) (§3.7, §5.7 `k3_kl`): mean_valid(e^ℓ − ℓ − 1), ℓ clamped to ±20.
    Shapes: [B, T] -> 0-dim, detached, ≥ 0."""
    log_ratio = _token_log_ratio(logp, logp_behav, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1(ℓ) − ℓ is exact near ℓ = 0, where e^ℓ − ℓ − 1 cancels to a rounding error that can be < 0
    k3 = (torch.expm1(log_ratio) - log_ratio).clamp_min(0.0) * mask.to(log_ratio.dtype)
    return k3.sum() / mask.sum().clamp_min(1)


def behaviour_drift(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sync budget's two measurements (§3.7) of how far a policy π is from the behaviour μ:

        kl_k3     mean_t(e^ℓ − ℓ − 1),  ℓ = logp − logp_behav        (k3 estimate of KL(μ ‖ π))
        ess_frac  Kish ESS / N of the sequence weights e^{Σ_t ℓ_t}     (sequences with a valid token)

    Which π is compared decides what is measured. Against the gradient point θ̂′ (what the importance
    weights correct to) it is drift of (m, σ) since the version plus the exploration noise between
    the slot's z and z′, which is there even before the mean moves. Against the rollout's own slot
    rebuilt from the current posterior, m_t + σ_t ⊙ z(seed), the noise realisation is held fixed and
    only the drift (plus the sampler–learner numerical mismatch) remains: that is the staleness the
    sync budget is for. Shapes: [B, T] -> 0-dim tensors, detached.
    """
    seq = _seq_log_ratio(logp, logp_behav, mask)[mask.bool().any(dim=1)]
    return {"kl_k3": kl_k3(logp, logp_behav, mask), "ess_frac": kish_ess_fraction(seq)}


@torch.no_grad()
def offpolicy_diagnostics(logp: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, *,
                          cap: float) -> dict[str, float]:
    """Per-batch off-policy diagnostics (§5.7), computed in float64 over valid tokens/sequences:

        kl                    mean_t(logp_behav − logp)          k3_kl   mean_t(e^ℓ − ℓ − 1)
        ess_frac              Kish ESS/N of the sequence weights Π_t ρ_t (the one the sync budget uses)
        ess_frac_verl         verl's: w = clamp(Π_t ρ_t, 1/C, C) broadcast to tokens, w̃ = w / mean_t(w),
                              1 / mean_t(w̃²)  (token-weighted, truncated)
        frac_truncated_token  share of tokens with ρ_t > C        frac_truncated_seq  same for Π_t ρ_t
        chi2_token            mean_t(ρ_t²) − 1                   chi2_seq  mean_i((Π_t ρ_t)²) − 1

    Shapes: [B, T] -> floats. Sequences without a valid token are left out.
    """
    _check_cap(cap)
    logp, logp_behav = logp.double(), logp_behav.double()
    valid, seq_valid = mask.bool(), mask.bool().any(dim=1)
    if not bool(seq_valid.any()):
        raise ValueError("offpolicy_diagnostics needs at least one valid token")
    tok = _token_log_ratio(logp, logp_behav, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[valid]
    seq = _seq_log_ratio(logp, logp_behav, mask)[seq_valid]
    tokens = mask.double().sum(dim=1)[seq_valid]
    w_verl = seq.exp().clamp(1.0 / cap, cap)
    w_verl = w_verl / ((tokens * w_verl).sum() / tokens.sum())
    return {
        "kl": float(kl_k1(logp, logp_behav, mask)),
        "k3_kl": float(kl_k3(logp, logp_behav, mask)),
        "ess_frac": float(kish_ess_fraction(seq)),
        "ess_frac_verl": float(tokens.sum() / (tokens * w_verl**2).sum()),
        "frac_truncated_token": float((tok.exp() > cap).double().mean()),
        "frac_truncated_seq": float((seq.exp() > cap).double().mean()),
        "chi2_token": float((2.0 * tok).exp().mean() - 1.0),
        "chi2_seq": float((2.0 * seq).exp().mean() - 1.0),
    }
