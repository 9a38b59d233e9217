"""Outcome advantages for grouped rollouts: GRPO, Dr.GRPO, LamPO's pairwise advantage, DAPO filtering.

Every function takes a `[B, G]` reward matrix (B prompts, G responses each) and returns per-sequence
quantities; the learner broadcasts a sequence advantage over that sequence's tokens. Spec:
algorithms.md §5.1 (GRPO), §5.2 (Dr.GRPO), §4.1–4.2 (LamPO), §5.3 (DAPO dynamic sampling).

Not here: the clipped surrogate and aggregation (losses.py), ROUGE-L for LamPO's semantic reward
(rouge.py), regenerating batches until enough groups survive the filter (the driver's loop).

Departures from the spec / the sources:
- `grpo_advantages`: a group of one response gets advantage 0. verl (§5.1) sets mean 0 / std 1 for
  such a group, which gives A = R, i.e. REINFORCE without a baseline; with one sample there is no
  baseline to compare against, so we return no signal instead.
- `zero_advantage_groups` / `dynamic_filter` compare rewards exactly (max == min). Rewards here are
  verifier outputs plus λ_sem·ROUGE, so ties are exact; a float tolerance would be a hidden knob.
"""

from __future__ import annotations

import torch


def _check_rewards(rewards: torch.Tensor, name: str = "rewards") -> None:
    if rewards.dim() != 2:
        raise ValueError(f"{name}: expected shape [B, G], got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {rewards.dtype}")


def grpo_advantages(rewards: torch.Tensor, *, eps: float = 1e-6, norm_std: bool = True) -> torch.Tensor:
    """GRPO outcome advantage, algorithms.md §5.1:  Â_i = (R_i − mean(R)) / (std(R) + eps).

    `std` is the unbiased (N−1) standard deviation, as `torch.std` in verl's
    `compute_grpo_outcome_advantage`. `norm_std=False` gives the Dr.GRPO form (§5.2).
    Args: rewards [B, G] float. Returns [B, G]; a group with G = 1 gets 0 (module docstring).
    """
    _check_rewards(rewards)
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not norm_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage, algorithms.md §5.2:  Â_i = R_i − mean(R)  (no std normalisation).

    Args: rewards [B, G] float. Returns [B, G]; a group with G = 1 gets 0.
    """
    return grpo_advantages(rewards, norm_std=False)


def lampo_advantages(rewards: torch.Tensor, seq_logp: torch.Tensor, *, tau: float = 1.5) -> torch.Tensor:
    """LamPO pairwise decomposed advantage (PDA), algorithms.md §4.1:

        A_i = 1/(G−1) · Σ_{j≠i} (R_i − R_j) · σ((s_i − s_j) / τ),   s_i = log π_old(o_i | q)

    Vectorised per group as D = R[:, None] − R[None, :], W = σ((s[:, None] − s[None, :]) / τ),
    A = (D ⊙ W).sum(1) / (G − 1); the diagonal adds nothing because D_ii = 0.
    As τ → ∞, σ → ½ and A_i → ½ · G/(G−1) · (R_i − R̄) (scaled Dr.GRPO). A is not zero-mean.
    Args: rewards [B, G] (already combined, see `combined_reward`), seq_logp [B, G] sequence
    log-probs under π_old (see `sequence_logprob`; treated as constants), tau > 0.
    Returns [B, G]; zeros when G < 2.
    """
    _check_rewards(rewards)
    if seq_logp.shape != rewards.shape:
        raise ValueError(f"seq_logp: expected shape {tuple(rewards.shape)} like rewards, got {tuple(seq_logp.shape)}")
    if not tau > 0:
        raise ValueError(f"tau: expected > 0, got {tau}")
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    s = seq_logp.detach().to(rewards.dtype)
    diff_r = rewards[:, :, None] - rewards[:, None, :]  # [B, G, G]
    weight = torch.sigmoid((s[:, :, None] - s[:, None, :]) / tau)  # [B, G, G]
    return (diff_r * weight).sum(dim=2) / (group_size - 1)


def sequence_logprob(logp: torch.Tensor, mask: torch.Tensor, mode: str = "sum") -> torch.Tensor:
    """Sequence log-probability from token log-probs, algorithms.md §4.1 (LamPO `seq_logp` option):

        "sum":  s_i = Σ_t M_{i,t} logp_{i,t}          (= log π(o_i | q), the default)
        "mean": s_i = Σ_t M_{i,t} logp_{i,t} / Σ_t M_{i,t}   (length-normalised; 0 for empty rows)

    Args: logp [B, T] token log-probs, mask [B, T] (bool or 0/1) of valid response tokens.
    Returns [B] in logp's dtype.
    """
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp/mask: expected equal shapes [B, T], got {tuple(logp.shape)} and {tuple(mask.shape)}")
    m = mask.to(logp.dtype)
    total = (logp * m).sum(dim=1)
    match mode:
        case "sum":
            return total
        case "mean":
            # an empty response has no evidence either way: s = 0, not NaN
            return total / m.sum(dim=1).clamp_min(1.0)
        case _:
            raise ValueError(f"mode: expected 'sum' or 'mean', got {mode!r}")


def zero_advantage_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Groups whose rewards are all equal, so every GRPO/Dr.GRPO/LamPO advantage is 0 (§4.1, §5.3).

    Args: rewards [B, G]. Returns bool [B], True where max_i R_i == min_i R_i (exact).
    """
    _check_rewards(rewards)
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def dynamic_filter(rewards: torch.Tensor, *, keep_all_if_empty: bool = False) -> torch.Tensor:
    """DAPO dynamic sampling filter, algorithms.md §5.3: keep the groups whose rewards differ.

        keep_b = not (R_{b,1} = … = R_{b,G})

    `keep_all_if_empty=True` is AReaL's `dynamic_sampling` fallback: when every group would be
    dropped, keep them all (the step then has zero advantages instead of no data).
    Args: rewards [B, G]. Returns bool keep mask [B].
    """
    keep = ~zero_advantage_groups(rewards)
    if keep_all_if_empty and not bool(keep.any()):
        return torch.ones_like(keep)
    return keep


def combined_reward(r_ext: torch.Tensor, r_sem: torch.Tensor, lam_sem: float) -> torch.Tensor:
    """LamPO reward, algorithms.md §4.2:  R = R_ext + λ_sem · R_sem.

    R_ext is the verifier reward (usually {0, 1}), R_sem the ROUGE-L F1 of the trace against the
    reference solution (rouge.py). Args: r_ext, r_sem of equal shape (e.g. [B, G]), lam_sem ≥ 0.
    Returns a tensor of that shape.
    """
    if r_ext.shape != r_sem.shape:
        raise ValueError(f"r_sem: expected shape {tuple(r_ext.shape)} like r_ext, got {tuple(r_sem.shape)}")
    if lam_sem < 0:
        raise ValueError(f"lam_sem: expected >= 0, got {lam_sem}")
    return r_ext + lam_sem * r_sem.to(r_ext.dtype)


def rescued_groups(rewards: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Groups whose reward spread exists only thanks to several perturbation slots (3PO diagnostic).

    rescued_b = (max_g R_bg > min_g R_bg) ∧ ∃ s: {R_bg : slot_bg = s} is non-empty and constant,
    i.e. the group has a learning signal, yet at least one slot alone would have produced a
    zero-advantage (dead) group. [OURS: the papers count groups rescued against a paired GRPO
    run; a paired run is not available online, so this counts the within-run counterfactual.]
    Args: rewards [B, G] float, slots [B, G] int. Returns bool [B].
    """
    _check_rewards(rewards)
    if slots.shape != rewards.shape:
        raise ValueError(f"slots: expected shape {tuple(rewards.shape)}, got {tuple(slots.shape)}")
    mixed = rewards.amax(dim=1) > rewards.amin(dim=1)
    any_uniform = torch.zeros_like(mixed)
    for s in torch.unique(slots).tolist():
        inside = slots == s
        hi = torch.where(inside, rewards, torch.full_like(rewards, -torch.inf)).amax(dim=1)
        lo = torch.where(inside, rewards, torch.full_like(rewards, torch.inf)).amin(dim=1)
        any_uniform |= inside.any(dim=1) & (hi == lo)
    return mixed & any_uniform
