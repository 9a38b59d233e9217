"""Per-token policy-gradient losses of the RLVR core (algorithms.md §0.1–§0.5, §5.3–§5.5).

What this is: the clipped surrogate (PPO/GRPO, DAPO clip-higher via eps_high, dual clip), the
decoupled PPO objective with behaviour weights (AReaL), KL-Cov, the four loss aggregation modes,
the KL estimators to a reference policy, entropy, and temperature-scaled token log-probs. These
also cover the action-space baselines of §5.4 (temperature: `token_logprobs`; entropy bonus:
`entropy_from_logits`; clip-higher: `eps_high`; KL-Cov: `kl_cov_loss`).
Every loss returns the per-token loss [B, T] (zero where mask = 0) plus a metrics dict of detached
0-dim tensors (clip fractions and the like); the caller aggregates with `aggregate_loss`, so the
denominators can be global over a mini-batch split into micro-batches (§0.2).

What this is not: advantages (advantages.py), sampler-vs-learner importance weights and
diagnostics (off_policy.py), any reduction across processes.

Departures from the specification:
- `aggregate_loss` "seq-mean-token-sum-norm" divides by N·max_len ([OURS] in §0.2; verl omits N).
- `aggregate_loss` counts N as the sequences with at least one valid token (a fully rejected
  sequence leaves the denominator, §5.6), and an empty mask gives 0 rather than NaN.
- `kl_cov_loss` clamps the log-ratio to ±20 like §0.1 (verl's KL-Cov does not clamp).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "k1+", "k2+", "k3+")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ M x / max(Σ M, 1), detached: the metric form of a token mean."""
    mask = mask.to(torch.float64)
    return ((x.detach().to(torch.float64) * mask).sum() / mask.sum().clamp_min(1.0)).to(torch.float32)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages [B] (one per sequence) or [B, T] -> broadcastable to [B, T]."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    assert adv.dim() == 2 and adv.shape[0] == like.shape[0], f"advantages {tuple(advantages.shape)}"
    return adv


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, eps_low: float, eps_high: float,
                      dual_clip_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (§0.1; DAPO clip-higher when eps_high > eps_low):

        ℓ = clamp(logp − logp_old, −20, 20),  r = e^ℓ
        L = max(−A r, −A clamp(r, 1 − ε_low, 1 + ε_high))
        L = min(L, −A c)  where A < 0   (dual clip, c > 1, when `dual_clip_c` is set)

    Shapes: logp, logp_old, mask [B, T]; advantages [B] or [B, T] -> loss [B, T] (0 where mask = 0).
    logp_old is a constant (detached). An optional rollout-correction weight (§5.6) multiplies the
    returned loss. Metrics: clip_frac (= clip_frac_low + clip_frac_high), dual_clip_frac, ppo_kl.
    """
    assert logp.dim() == 2 and logp.shape == logp_old.shape == mask.shape, (logp.shape, mask.shape)
    adv = _per_token(advantages, logp)
    log_ratio = (logp - logp_old.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped  # A > 0: r > 1 + ε_high;  A < 0: r < 1 − ε_low
    metrics = {"clip_frac": _masked_mean(clipped, mask),
               "clip_frac_high": _masked_mean(clipped & (adv > 0), mask),
               "clip_frac_low": _masked_mean(clipped & (adv < 0), mask),
               "ppo_kl": _masked_mean(-log_ratio, mask)}
    if dual_clip_c is not None:
        assert dual_clip_c > 1.0, f"dual_clip_c must exceed 1, got {dual_clip_c}"
        bound = -adv * dual_clip_c
        metrics["dual_clip_frac"] = _masked_mean((adv < 0) & (loss > bound), mask)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return torch.where(mask.bool(), loss, torch.zeros_like(loss)), metrics


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str, *, max_len: int | None = None,
                   num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (§0.2), M the mask, N the sequence count:

        token-mean               Σ M L / Σ M                    (DAPO, verl default, AReaL)
        seq-mean-token-mean      (1/N) Σ_i (Σ_t M L / Σ_t M)    (original GRPO)
        seq-mean-token-sum       (1/N) Σ_i Σ_t M L
        seq-mean-token-sum-norm  Σ_i Σ_t M L / (N · max_len)    (Dr.GRPO; N·max_len is [OURS])

    `num_tokens` / `num_seqs` replace Σ M / N by the totals of the whole mini-batch when this call
    sees one micro-batch of it (§0.2: denominators must be global). N counts sequences with at
    least one valid token. Empty denominators count as 1 (the loss is then 0, not NaN).
    """
    assert loss_tok.shape == mask.shape and loss_tok.dim() == 2, (loss_tok.shape, mask.shape)
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    mask = mask.to(loss_tok.dtype)
    masked = loss_tok * mask
    tokens_per_seq = mask.sum(dim=1)  # [B]
    # tensor denominators (no .item()): no device sync inside the loss
    n_seqs = (tokens_per_seq > 0).sum().clamp_min(1) if num_seqs is None else max(num_seqs, 1.0)
    if mode == "token-mean":
        return masked.sum() / (mask.sum().clamp_min(1.0) if num_tokens is None else max(num_tokens, 1.0))
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=1) / tokens_per_seq.clamp_min(1.0)).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seqs
    if max_len is None or max_len < 1:
        raise ValueError(f"max_len (max response length) is required for {mode}, got {max_len}")
    return masked.sum() / (n_seqs * max_len)


def _kl_value(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    y = (-x).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # y = log π_ref − log π_θ
    return (torch.exp(y) - y - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to π_ref (§0.3), with x = logp − ref_logp:

        k1: x      k2: ½ x²      k3: clamp(e^{y} − y − 1, −10, 10), y = clamp(−x, −20, 20)
        "<k>+": the value of <k> with the gradient of k2 (straight-through; unbiased KL gradient)

    Shapes: logp, ref_logp [B, T] -> [B, T]; aggregate with the PG loss's mode (L = L_pg + β agg(KL)).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    assert logp.shape == ref_logp.shape, (logp.shape, ref_logp.shape)
    x = logp - ref_logp
    if kind.endswith("+"):
        k2 = 0.5 * x * x
        return k2 - k2.detach() + _kl_value(x, kind[:-1]).detach()
    return _kl_value(x, kind)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H_t = −Σ_v π(v) log π(v) = logsumexp(z) − Σ_v softmax(z)_v z_v with z = logits / T (§0.4, §0.5).

    Shapes: logits [B, T, V] -> [B, T]. The entropy bonus is L = L_pg − c_H agg(H).
    """
    assert temperature > 0, f"temperature must be positive, got {temperature}"
    z = logits / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token] per position (§0.5: T is the sampler's temperature).

    Shapes: logits [B, T, V], token_ids [B, T] (int) -> [B, T]. Computed as z_tok − logsumexp(z)
    so no [B, T, V] log-softmax is kept.
    """
    assert temperature > 0, f"temperature must be positive, got {temperature}"
    assert logits.shape[:-1] == token_ids.shape, (logits.shape, token_ids.shape)
    z = logits / temperature
    return z.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def decoupled_ppo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float,
                       behav_imp_weight_cap: float | None = None,
                       dual_clip_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (§5.5), per token:

        u = π_θ / π_prox;  Lclip = clipped_surrogate(u)            (optional dual clip)
        w = π_prox / π_behav = exp(clamp(logp_prox − logp_behav, ±20))   (detached)
        keep = mask ∧ (w ≤ cap)   when a cap is set  (MASK, not truncate)
        L = keep · Lclip · w

    Aggregate with the ORIGINAL mask (e.g. token-mean: Σ L / Σ mask), as AReaL does: capped tokens
    stay in the denominator. Shapes: all [B, T], advantages [B] or [B, T] -> loss [B, T].
    Metrics: those of `clipped_surrogate` plus behav_mask_frac (share of valid tokens capped out)
    and behav_imp_weight (mean w over kept tokens).
    """
    assert logp_behav.shape == logp.shape, (logp_behav.shape, logp.shape)
    loss, metrics = clipped_surrogate(logp, logp_prox, advantages, mask, eps_low=eps_low,
                                      eps_high=eps_high, dual_clip_c=dual_clip_c)
    weight = torch.exp((logp_prox - logp_behav).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = mask.bool()
    if behav_imp_weight_cap is not None:
        keep = keep & (weight <= behav_imp_weight_cap)
    metrics["behav_mask_frac"] = _masked_mean(mask.bool() & ~keep, mask)
    metrics["behav_imp_weight"] = _masked_mean(weight, keep)
    return torch.where(keep, loss * weight, torch.zeros_like(loss)), metrics


def kl_cov_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, kl_cov_ratio: float, ppo_kl_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025; §5.4, verl `compute_policy_loss_kl_cov`), per token:

        ℓ = clamp(logp − logp_old, ±20),  r = e^ℓ,  L = −A r               (no clipping)
        cov_t = (A_t − Ā)(logp_t − mean logp)   over valid tokens (detached)
        on the top max(1, ⌊ratio · n_valid⌋) tokens by cov_t:  L = −A r + c |ℓ|

    Shapes: logp, logp_old, mask [B, T]; advantages [B] or [B, T] -> loss [B, T] (0 where mask = 0).
    kl_cov_ratio = 0 selects no token. Metrics: kl_cov_frac (share selected), ppo_kl_abs (mean |ℓ|).
    """
    assert logp.dim() == 2 and logp.shape == logp_old.shape == mask.shape, (logp.shape, mask.shape)
    assert 0.0 <= kl_cov_ratio <= 1.0, f"kl_cov_ratio must be in [0, 1], got {kl_cov_ratio}"
    adv = _per_token(advantages, logp).expand_as(logp)
    log_ratio = (logp - logp_old.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss_pg = -adv * torch.exp(log_ratio)
    valid = mask.bool()
    n_valid = int(valid.sum())
    n_sel = max(1, int(n_valid * kl_cov_ratio)) if n_valid > 0 and kl_cov_ratio > 0 else 0
    selected = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
    if n_sel:
        adv_v, logp_v = adv[valid].detach(), logp[valid].detach()
        cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
        top = torch.topk(cov, n_sel).indices
        selected.view(-1)[valid.reshape(-1).nonzero().squeeze(1)[top]] = True
    loss = torch.where(selected, loss_pg + ppo_kl_coef * log_ratio.abs(), loss_pg)
    metrics = {"kl_cov_frac": torch.tensor(n_sel / max(n_valid, 1), dtype=torch.float32),
               "ppo_kl_abs": _masked_mean(log_ratio.abs(), mask)}
    return torch.where(valid, loss, torch.zeros_like(loss)), metrics
