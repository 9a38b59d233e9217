"""What the learner optimises, each variant chosen once (`make_estimator`, `make_policy_loss`): the
advantage estimator (the rewards it uses and its advantages, algorithms/advantages.py; it says
whether it needs π_prox before the first update) and the per-token policy loss with its behaviour
correction (algorithms/losses.py, off_policy.py); and the groups' own figures (malformed and
truncated shares, staleness, tokens)."""

from __future__ import annotations

import torch

from threepo.algorithms import advantages as adv_math
from threepo.algorithms import losses, off_policy
from threepo.algorithms.rouge import rouge_l_rewards
from threepo.services.learner.config import AlgoConfig
from threepo.services.wire.batching import MALFORMED, TrainBatch


class GroupAdvantages:
    """GRPO's std-normalised (`grpo`) or Dr.GRPO's mean-centred (`dr_grpo`) advantages of the verifier's rewards."""

    needs_prox = False  # nothing but the rewards

    def __init__(self, kind: str) -> None:
        self.estimate = adv_math.dr_grpo_advantages if kind == "dr_grpo" else adv_math.grpo_advantages

    def rewards(self, batch: TrainBatch) -> torch.Tensor:
        """The [B/G, G] rewards the advantages use: the verifier's."""
        return batch.rewards

    def advantages(self, rewards: torch.Tensor, batch: TrainBatch, logp_prox: torch.Tensor | None) -> torch.Tensor:
        return self.estimate(rewards)


class LamPOAdvantages:
    """LamPO's pairwise advantages (algorithms.md §4.1) of the verifier's reward plus λ_sem·ROUGE-L."""

    needs_prox = True  # Δs uses each rollout's π_prox at its first update, before that update

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo

    def rewards(self, batch: TrainBatch) -> torch.Tensor:
        size = batch.rewards.shape[1]
        sem = torch.stack([rouge_l_rewards(batch.texts[g * size:(g + 1) * size], solution)
                           if solution else torch.zeros(size, dtype=torch.float64)
                           for g, solution in enumerate(batch.solutions)]).to(batch.rewards.dtype)
        return adv_math.combined_reward(batch.rewards, sem, self.algo.lampo_lam_sem)

    def advantages(self, rewards: torch.Tensor, batch: TrainBatch, logp_prox: torch.Tensor) -> torch.Tensor:
        """One policy for all rollouts of a group (whole groups per update, M3PO's groups are one slot each)."""
        seq_logp = adv_math.sequence_logprob(logp_prox, batch.mask, self.algo.lampo_seq_logp)
        return adv_math.lampo_advantages(rewards, seq_logp.view_as(rewards).to(rewards.device), tau=self.algo.lampo_tau)


def make_estimator(algo: AlgoConfig):
    match algo.advantage:
        case "lampo":
            return LamPOAdvantages(algo)
        case "grpo" | "dr_grpo":
            return GroupAdvantages(algo.advantage)
    raise ValueError(f"algo.advantage: expected grpo, dr_grpo or lampo, got {algo.advantage!r}")


def step_advantages(estimator, batch: TrainBatch, rewards: torch.Tensor,
                    logp_prox: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """Per-rollout advantages [B] of `estimator` from the [B/G, G] reward matrix, and their metrics."""
    advantages = estimator.advantages(rewards, batch, logp_prox)
    zero = adv_math.zero_advantage_groups(rewards)
    rescued = adv_math.rescued_groups(batch.rewards, batch.slots)
    return advantages.reshape(-1).float().to(batch.mask.device), {
        "reward_mean": float(batch.rewards.mean()), "advantage_mean": float(advantages.mean()),
        "zero_adv_frac": float(zero.float().mean()), "rescued_groups": float(rescued.sum())}


class PolicyLoss:
    """Per-token policy loss of `algo.loss` (algorithms.md §0.1, §5.4, §5.5) with the behaviour
    correction: `loss(logp, prox, behav, advantages, mask)` → (per-token loss, the mask to aggregate
    it with, metrics). `masks_tokens`: the correction drops tokens (seq_mis, token_mis), so a split
    update needs π_prox of all its rows before its first loss; `whole_batch`: the loss selects tokens
    over the whole update (KL-Cov), so the update is not split."""

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo
        self.clip = dict(eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip_c=algo.dual_clip_c or None)
        self.masks_tokens = algo.is_correction in ("seq_mis", "token_mis")
        self.whole_batch = algo.loss == "kl_cov"

    def correction(self, prox, behav, mask):
        """The correction's token weights and effective mask (off_policy.correction_weights)."""
        return off_policy.correction_weights(self.algo.is_correction, prox, behav, mask, cap=self.algo.is_cap)

    def __call__(self, logp, prox, behav, advantages, mask):
        weights, mask_eff = self.correction(prox, behav, mask)
        loss_tok, metrics = self.surrogate(logp, prox, advantages, mask_eff)
        metrics["is_weight_mean"] = (weights.sum(1) / mask.sum(1).clamp(min=1)).mean()
        metrics["is_clip_frac"] = off_policy.capped_fraction(self.algo.is_correction, prox, behav, mask,
                                                             cap=self.algo.is_cap)
        return loss_tok * weights, mask_eff, metrics

    def surrogate(self, logp, prox, advantages, mask):
        return losses.clipped_surrogate(logp, prox, advantages, mask, **self.clip)


class KLCovLoss(PolicyLoss):
    """KL-Cov: no clip, |log π_θ/π_prox| penalty on the top `kl_cov_ratio` tokens by covariance."""

    def surrogate(self, logp, prox, advantages, mask):
        return losses.kl_cov_loss(logp, prox, advantages, mask, kl_cov_ratio=self.algo.kl_cov_ratio,
                                  ppo_kl_coef=self.algo.kl_cov_coef)


class DecoupledPPOLoss(PolicyLoss):
    """AReaL's decoupled PPO: the token weights π_prox/μ built in, tokens above `is_cap` masked out,
    aggregated over the original mask."""

    def __call__(self, logp, prox, behav, advantages, mask):
        loss_tok, metrics = losses.decoupled_ppo_loss(logp, prox, behav, advantages, mask,
                                                      behav_imp_weight_cap=self.algo.is_cap, **self.clip)
        return loss_tok, mask, metrics


def make_policy_loss(algo: AlgoConfig) -> PolicyLoss:
    match algo.loss:
        case "ppo":
            return PolicyLoss(algo)
        case "kl_cov":
            return KLCovLoss(algo)
        case "decoupled_ppo":
            return DecoupledPPOLoss(algo)
    raise ValueError(f"algo.loss: expected ppo, decoupled_ppo or kl_cov, got {algo.loss!r}")


def group_metrics(batch: TrainBatch, step_count: int) -> dict[str, float]:
    """Malformed and truncated shares, staleness (in learner steps), rollouts and completion tokens of the step."""
    staleness = step_count - 1 - batch.published_steps
    return {"malformed_rate": float((batch.statuses == MALFORMED).mean()),
            "truncated_rate": float(batch.truncated.mean()), "rollouts": float(len(batch.truncated)),
            "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
            "completion_tokens": float(batch.mask.sum())}
