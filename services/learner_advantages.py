"""What the learner computes from a step's scored groups before any forward pass: the rewards the
advantages use, the advantages of the configured estimator (algorithms/advantages.py), and the
groups' own figures (malformed and truncated shares, staleness, tokens)."""

from __future__ import annotations

import torch

from threepo.algorithms import advantages as adv_math
from threepo.algorithms.rouge import rouge_l_rewards
from threepo.services.batching import MALFORMED, TrainBatch
from threepo.services.learner_config import AlgoConfig


def step_rewards(batch: TrainBatch, algo: AlgoConfig) -> torch.Tensor:
    """The [B/G, G] rewards the advantages use: the verifier's, plus λ_sem·ROUGE-L for LamPO."""
    if algo.advantage != "lampo":
        return batch.rewards
    size = batch.rewards.shape[1]
    sem = torch.stack([rouge_l_rewards(batch.texts[g * size:(g + 1) * size], solution)
                       if solution else torch.zeros(size, dtype=torch.float64)
                       for g, solution in enumerate(batch.solutions)]).to(batch.rewards.dtype)
    return adv_math.combined_reward(batch.rewards, sem, algo.lampo_lam_sem)


def step_advantages(batch: TrainBatch, rewards: torch.Tensor, algo: AlgoConfig,
                    logp_prox: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """Per-rollout advantages [B] from the [B/G, G] reward matrix (the configured estimator).
    LamPO's Δs uses `logp_prox`, each rollout's π_prox at its first update: one policy for all
    rollouts of a group (whole groups per update, M3PO's groups are one slot each)."""
    if algo.advantage == "lampo":
        seq_logp = adv_math.sequence_logprob(logp_prox, batch.mask, algo.lampo_seq_logp)
        advantages = adv_math.lampo_advantages(rewards, seq_logp.view_as(rewards).to(rewards.device), tau=algo.lampo_tau)
    elif algo.advantage == "dr_grpo":
        advantages = adv_math.dr_grpo_advantages(rewards)
    else:
        advantages = adv_math.grpo_advantages(rewards)
    zero = adv_math.zero_advantage_groups(rewards)
    rescued = adv_math.rescued_groups(batch.rewards, batch.slots)
    return advantages.reshape(-1).float().to(batch.mask.device), {
        "reward_mean": float(batch.rewards.mean()), "advantage_mean": float(advantages.mean()),
        "zero_adv_frac": float(zero.float().mean()), "rescued_groups": float(rescued.sum())}


def group_metrics(batch: TrainBatch, step_count: int) -> dict[str, float]:
    """Malformed and truncated shares, staleness (in learner steps), rollouts and completion tokens of the step."""
    staleness = step_count - 1 - batch.published_steps
    return {"malformed_rate": float((batch.statuses == MALFORMED).mean()),
            "truncated_rate": float(batch.truncated.mean()), "rollouts": float(len(batch.truncated)),
            "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
            "completion_tokens": float(batch.mask.sum())}
