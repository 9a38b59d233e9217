"""The learner: owns the training copy of the model and, through its optimizer object, the optimizer
state (services/learner/optimizers.py: IVON's posterior, AdamW, or AdamW placed by DeepSpeed).

`step(groups, batches, scores)` collates complete, scored groups (rows of the step's array batches,
services/wire/batching.py) once and turns them into advantages and the off-policy-corrected loss (all
math in algorithms/) and takes `ppo_epochs × mini_batches` optimizer updates, each at the gradient
point of `exploration.gradient_points` — a fresh posterior sample θ̂′ per update (M3PO: one per slot
group, K = M Monte-Carlo samples per IVON step), or the mean for GRPO with AdamW. Every update's
proximal policy π_prox is the policy at the start of the step at that update's gradient point
(computed before the first update, no grad), so later updates see ratios ≠ 1 and the clips act; the
importance weights correct each rollout's behaviour μ (its slot at its version) to π_prox. The sync
budget acts on the drift of each rollout's own slot rebuilt from the start-of-step posterior, not on
the exploration noise between slots (off_policy.behaviour_drift); an IVON step that publishes on
staleness anyway does not measure it, and on one CPU rank (`beside`) its forward runs in a process
of its own beside the update (services/learner/drift_process.py). As one of R data-parallel ranks (`ranks`,
services/learner/ranks.py) it computes its share of each point's rows, on gradients summed over the
ranks, and IVON steps only the tensors this rank owns.

When the budget publishes, the noise control (services/learner/noise_control.py) chooses the new
version's slots — seeds, and the σ scale that holds their KL to the mean at noise.target_kl — from
what the samplers measured on the slots' own rollouts (`samplers_measure_noise`, the hf engine) or
else on a probe of the step's rollouts; `published` sends them with (m, σ). Each step reports its
time by phase (services/learner/phases.py).

Every variant is chosen once, in `__init__`: the optimizer (`make_optimizer`), the advantage
estimator and the policy loss (services/learner/objective.py), what runs around the optimizer step
(services/learner/around.py: nothing, or VP2O) and the noise control (or none). The step asks them;
it tests no names (where each update takes its gradient comes from the pure
`exploration.gradient_points`, which reads the exploration kind).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from threepo.algorithms import advantages as adv_math
from threepo.algorithms import losses
from threepo.algorithms.exploration import gradient_points
from threepo.algorithms.noise_mask import NoiseConfig
from threepo.algorithms.sync_budget import sync_decision
from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.learner.around import make_around
from threepo.services.learner.config import AlgoConfig, VP2OConfig, has_drift_process
from threepo.services.learner.drift_process import DriftProcess, Pending
from threepo.services.learner.memory import (bytes_per_position, denominators, head_chunk, micro_batches,
                                             over_micro_batches)
from threepo.services.learner.noise_control import make_noise_control
from threepo.services.learner.objective import group_metrics, make_estimator, make_policy_loss, step_advantages
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.learner.optimizers import make_optimizer
from threepo.services.learner.phases import PhaseClock
from threepo.services.learner.proximal import StartLogprobs, drift_metrics, drift_sample
from threepo.services.learner.ranks import Ranks, SingleRank
from threepo.services.model.lora import LoRAConfig, adapters_off, attach, merged_weights, save_adapter
from threepo.services.model.modeling import load_model, trainable_named_parameters
from threepo.services.model.prefix_forward import plain_head, prompt_runs, row_logprobs, row_token_stats
from threepo.services.wire.batching import TrainBatch, collate
from threepo.services.wire.messages import CompletionBatch, GroupRows, PublishedVersion, ScoreBatch

_NO_DRIFT = (0.0, 1.0)  # (KL, ESS fraction) of a behaviour policy equal to the current one


@dataclass(frozen=True)
class StepResult:
    """Metrics of one learner step and whether the sync budget fired (then `published()` gives the
    new version's weights; the posterior server numbers it)."""

    step: int
    metrics: dict[str, float]
    publish: bool
    publish_reason: str | None


class Learner:
    """Training copy + optimizer; one `step` per batch of groups; publishes on the sync budget."""

    def __init__(self, model_path: str, algo: AlgoConfig, optim: OptimConfig, sync: SyncConfig, *,
                 temperature: float, max_new_tokens: int, threads: int = 1,
                 vp2o: VP2OConfig | None = None, ranks: Ranks | None = None, device: str = "cpu",
                 deepspeed_stage: int = -1, shared_prefix: bool = True, drift_process: bool = False,
                 activation_mb: int | Literal["off"] = "off", gradient_checkpointing: bool = False, bf16: bool = False,
                 noise: NoiseConfig | None = None, noise_prompts: list[list[int]] | None = None,
                 lora: LoRAConfig | None = None, adapter_versions: bool = False,
                 samplers_measure_noise: bool = False) -> None:
        torch.set_num_threads(threads)
        # a confident policy's softmax underflows into denormals, which made CPU steps ~1.8x slower
        torch.set_flush_denormal(True)
        self.model_path, self.algo, self.optim_cfg, self.sync = model_path, algo, optim, sync
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.ranks, self.device = ranks or SingleRank(), torch.device(device)  # alone, or one of R ranks
        self.model = load_model(model_path).to(self.device).train()
        self.lora = lora or LoRAConfig()
        if self.lora.rank:  # the adapters are then the trainable parameters, the base frozen
            attach(self.model, self.lora)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plain_head(self.model)  # probed now, before any hook watches a forward
        self.named = trainable_named_parameters(self.model)
        # the activation budget in bytes, 0: never split (learner/memory.py)
        self.budget = 0 if activation_mb == "off" else activation_mb << 20
        self.checkpointing = gradient_checkpointing
        self.bf16 = bf16  # mixed precision: the steps' matmuls in bfloat16, everything kept in fp32
        self.chunk = head_chunk(self.model.config, self.budget)
        # the KL penalty's reference, chosen once: the starting model, or under LoRA the model with its
        # adapters left out (no second copy)
        self.ref_model = load_model(model_path).to(self.device).eval() if algo.kl_coef and not self.lora.rank else None
        self.reference = (lambda: adapters_off(self.model)) if self.lora.rank else (lambda: nullcontext(self.ref_model))
        # the drift forwards at slot weights in a process beside the update (config.has_drift_process)
        noise = noise or NoiseConfig()
        self.drift_process = (DriftProcess(model_path, self.named, temperature, self.chunk, bf16, noise.slot_rank) if drift_process and
                       has_drift_process(optim.name, self.ranks.world, deepspeed_stage, self.device.type, self.lora.rank) else None)
        self.optimizer = make_optimizer(self.model, self.named, optim, self.ranks, deepspeed_stage, noise, self.lora,
                                        adapter_versions)
        self.noise = make_noise_control(noise, serves_noise=self.optimizer.variational and algo.exploration != "none",
                                        n_slots=algo.n_slots, base_seed=algo.seed, temperature=temperature,
                                        prompts=noise_prompts, device=self.device,
                                        measured_by_samplers=samplers_measure_noise)
        self.slots = None  # (seed, scale) of the slots of the version published last (noise control)
        self.estimator, self.loss = make_estimator(algo), make_policy_loss(algo)
        self.around = make_around(self.model, self.optimizer, (vp2o or VP2OConfig()) if algo.vp2o else None)
        self.step_count, self.steps_since_sync = 0, 0
        self.shared_prefix = shared_prefix and not self.around.whole_update
        self.clock = PhaseClock()  # where each step's time goes (services/learner/phases.py)

    # ---- one training step ------------------------------------------------------------------
    def step(self, groups: Sequence[GroupRows], batches: Sequence[CompletionBatch],
             scores: Sequence[ScoreBatch]) -> StepResult:
        """One step on `groups`, whose rows live in the step's `batches` (scored by `scores`)."""
        # no cast cache: IVON writes each posterior sample into the same parameters, in place
        with (torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False),
              self.clock.phase("other")):
            result = self._step(groups, batches, scores)
        result.metrics.update(self.clock.take())
        return result

    def _step(self, groups: Sequence[GroupRows], batches: Sequence[CompletionBatch],
              scores: Sequence[ScoreBatch]) -> StepResult:
        started = time.perf_counter()
        batch = collate(groups, batches, scores).to(self.device)
        rewards = self.estimator.rewards(batch)
        keep = adv_math.dynamic_filter(rewards) if self.algo.dynamic_filter else torch.ones(len(groups), dtype=torch.bool, device=self.device)
        updates = self._updates(batch, keep)
        measured = self._drift_rows(batch, updates)
        start, pending = self._start_logprobs(batch, updates, measured)
        prox_first = self.estimator.needs_prox  # e.g. LamPO's Δs: π_prox before the first update
        advantages, adv_metrics = step_advantages(self.estimator, batch, rewards,
                                                  start.first(updates) if prox_first else None)
        diag, around_metrics, size = [], {}, batch.rewards.shape[1]
        for u, points in enumerate(updates):
            for seed, rows in points:
                mine = self.ranks.mine(rows, size)  # all rows alone; this rank's groups of them among R
                with self.clock.around("sample", self.optimizer.at(seed)):
                    metrics, logp = self._backward(batch, mine, advantages[mine], start.get(seed, mine))
                if u == 0:
                    start.put(seed, mine, logp)  # update 0 runs at the start weights: its own π_prox
                diag.append((float(batch.mask[mine].sum()), metrics))
            with self.clock.phase("drift"):
                pending.join(start)  # before the first optimizer step moves (m, σ)
            with self.clock.phase("step"):
                around_metrics = self.around.step()
        with self.clock.phase("drift"):
            pending.join(start)
        self.ranks.share_logprobs(start, [((s, 1.0), r) for s, r in updates[0]] if updates and not prox_first else [])
        self.step_count += 1
        self.steps_since_sync += 1
        metrics = {**adv_metrics, **self.ranks.point_metrics(diag), **group_metrics(batch, self.step_count),
                   **around_metrics, **drift_metrics(batch, start, updates, measured),
                   "updates": float(len(updates)), "filtered_groups": float((~keep).sum())}
        drift = (metrics["kl_k3_drift"], metrics["ess_frac_drift"]) if len(measured) else _NO_DRIFT
        decision = self._sync_decision(*drift, self.steps_since_sync)
        with self.clock.phase("noise"):  # the samplers' measurements, or the probe: this step's rollouts (in
            # runs sharing a prompt where the update's forward shares them)
            self.noise.observe(batch, batch.rewards.shape[1] if self.shared_prefix else 0)
        if decision.publish:
            self.around.on_sync()
            self.steps_since_sync = 0
            with self.clock.phase("noise"):
                self.slots = self.noise.plan(self.model, self.optimizer, self.step_count)
        metrics.update(self.noise.latest)
        metrics["step_time_s"] = time.perf_counter() - started
        metrics.update(self.optimizer.metrics())
        return StepResult(step=self.step_count, metrics=metrics, publish=decision.publish,
                          publish_reason=decision.reason)

    def _updates(self, batch: TrainBatch, keep: torch.Tensor) -> list[list[tuple[int | None, torch.Tensor]]]:
        """The step's optimizer updates: `ppo_epochs` passes over the kept groups, each split into
        `mini_batches` contiguous shares of whole groups; an update is a list of (gradient seed, rows),
        one per Monte-Carlo sample (`exploration.gradient_points`: fresh θ̂′ per update)."""
        a, size = self.algo, batch.rewards.shape[1]
        kept = keep.nonzero().flatten().cpu().numpy()
        shares = np.array_split(kept, min(a.mini_batches, len(kept))) if len(kept) else []
        slots, updates = batch.slots.reshape(-1), []
        for _ in range(a.ppo_epochs):
            for share in shares:
                rows = torch.cat([torch.arange(g * size, (g + 1) * size) for g in share.tolist()])
                points = gradient_points(a.exploration, variational=self.optimizer.variational,
                                         base_seed=a.seed, step=self.step_count, update=len(updates),
                                         slots=slots[rows].tolist())
                updates.append([(seed, rows[torch.tensor(at)]) for seed, at in points])
        return updates

    def _start_logprobs(self, batch: TrainBatch, updates: list, measured: torch.Tensor) -> tuple[StartLogprobs, Pending]:
        """Token log-probs at the start of the step (no grad), for every point that needs them before
        the weights move: the π_prox of updates ≥ 1, every rollout's own slot θ̂ = m + c · σ ⊙ z(seed)
        at the current (m, σ) with the slot's own σ multiplier c for the drift diagnostic, and for
        LamPO also update 0's π_prox (Δs comes first). Update 0's π_prox is otherwise its own first
        forward (stored by `step`). Points are (seed, c); gradient points have c = 1. Points only the
        drift diagnostic needs are computed beside the update when the learner can (`DriftProcess`,
        once it has loaded its model): they are in `start` once the returned `Pending` is joined."""
        prox_first, for_updates, for_drift = self.estimator.needs_prox, {}, {}
        points = list(zip(batch.slot_seeds, batch.slot_scales))
        for r in measured.tolist():
            for_drift.setdefault(points[r], set()).add(r)
        for u, points in enumerate(updates):
            for seed, rows in points:
                if u or prox_first:
                    for_updates.setdefault((seed, 1.0), set()).update(rows.tolist())
        for seed, rows in ([] if prox_first or not updates else updates[0]):
            for need in (for_updates, for_drift):
                need.get((seed, 1.0), set()).difference_update(rows.tolist())
        ready = self.drift_process is not None and self.drift_process.is_ready()
        drift_only = {p: torch.tensor(sorted(r)) for p, r in for_drift.items() if r and p not in for_updates} if ready else {}
        for_updates_only = {point for point, rows in for_updates.items() if rows}
        for point in set(for_drift) - set(drift_only):
            for_updates.setdefault(point, set()).update(for_drift[point])
        start, size = StartLogprobs(batch.mask.shape, batch.mask.device), batch.rewards.shape[1]
        need = {point: torch.tensor(sorted(rows)) for point, rows in for_updates.items() if rows}
        pending = (self.drift_process.start(batch, drift_only, *self.optimizer.served_posterior(),
                                     lambda rows: self._run(batch, rows)) if drift_only else Pending())
        for (seed, scale), rows in need.items():
            idx = self.ranks.mine(rows, size)  # every rank takes part in each point's collectives
            drift_only = (seed, scale) in for_drift and (seed, scale) not in for_updates_only
            with (self.clock.phase("drift" if drift_only else "forward"), torch.no_grad(),
                  self.clock.around("drift" if drift_only else "sample",
                                    self.optimizer.at(seed, train=False, scale=scale, served=(seed, scale) in for_drift))):
                logp = self._logprobs(batch, idx)
            start.put(seed, idx, logp, scale)
        self.ranks.share_logprobs(start, list(need.items()))
        return start, pending

    def _sync_decision(self, kl: float, ess_frac: float, steps_since_sync: int):
        if kl != kl:  # NaN: the updated policy's log-probs are no longer numbers
            raise FloatingPointError(f"learner step {self.step_count}: the policy diverged (its drift KL is NaN) "
                                     f"after an update with optim.name={self.optim_cfg.name}, optim.lr="
                                     f"{self.optim_cfg.lr:g}: lower optim.lr (AdamW takes ~1e-6–1e-4; the [optim] "
                                     "default 10 is IVON's)")
        return sync_decision(kl=kl, ess_frac=ess_frac, steps_since_sync=steps_since_sync, kappa=self.sync.kappa,
                             eta=self.sync.eta, max_staleness=self.sync.max_staleness)

    def _drift_rows(self, batch: TrainBatch, updates: list) -> torch.Tensor:
        """The rollouts the drift diagnostic measures this step. Where it costs a forward of its own (a
        posterior: each measured rollout's slot rebuilt), `sync.drift_rows` of one slot in pairs that
        share a prompt (`drift_sample`; before the step counter moves: one sample per step), and none
        on a step with updates that the budget publishes with no drift at all (staleness): the
        measurement could not change the decision. Where it is update 0's own forward (AdamW: the
        behaviour is the served mean), every rollout: it costs nothing."""
        if not self.optimizer.variational and updates:
            return torch.arange(len(batch.slot_seeds))
        if updates and self._sync_decision(*_NO_DRIFT, self.steps_since_sync + 1).publish:
            return torch.zeros(0, dtype=torch.long)
        return drift_sample(list(zip(batch.slot_seeds, batch.slot_scales)),
                            None if self.sync.drift_rows == "all" else self.sync.drift_rows,
                            step=self.step_count, seed=self.algo.seed, group_size=batch.rewards.shape[1])

    def _logprobs(self, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        if not len(rows):
            return batch.logp_behav[rows]  # [0, T]: another rank's rows
        return self._row_logprobs(self.model, batch, rows)

    def _row_logprobs(self, model, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        """Token log-probs of `rows` (services/model/prefix_forward.py: each prompt computed once when the
        rows come in runs sharing one; the head on completion positions only, in chunks)."""
        return row_logprobs(model, batch.input_ids[rows], batch.attn[rows], batch.mask[rows], batch.targets[rows],
                            self._run(batch, rows), self.temperature, self.chunk)

    def _run(self, batch: TrainBatch, rows: torch.Tensor) -> int:
        """How many consecutive `rows` share each prompt (0: use the plain forward)."""
        return prompt_runs(rows, batch.rewards.shape[1]) if self.shared_prefix else 0

    def _backward(self, batch: TrainBatch, rows: torch.Tensor, advantages: torch.Tensor,
                  logp_prox: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
        """Loss on `rows` at the current weights against π_prox (None: this forward is π_prox);
        backward, in micro-batches over `activation_mb` (the denominators all the rows'); detached
        diagnostics and token log-probs. No rows (another rank's share): only the denominators' collective."""
        if not len(rows):
            self.ranks.denominators(batch.mask[rows])
            return {}, batch.logp_behav[rows]
        parts = self._micro(batch, rows)
        if len(parts) == 1:
            return self._micro_backward(batch, rows, advantages, logp_prox, None)
        mask = batch.mask[rows]
        if self.loss.masks_tokens:  # the mask needs π_prox before the first loss
            if logp_prox is None:
                with torch.no_grad():
                    logp_prox = torch.cat([self._logprobs(batch, part) for part in parts])
            mask = self.loss.correction(logp_prox, batch.logp_behav[rows], mask)[1]
        agg = self.ranks.denominators(mask) or denominators(mask)
        return over_micro_batches(parts, batch.mask, advantages, logp_prox,
                                  lambda part, adv, prox: self._micro_backward(batch, part, adv, prox, agg))

    def _micro(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` in micro-batches (services/learner/memory.py); KL-Cov's and VP2O's terms are over all of them."""
        per = bytes_per_position(self.model, batch.input_ids.shape[1], self.checkpointing)
        return [rows] if self.loss.whole_batch or self.around.whole_update else micro_batches(
            rows, self._run(batch, rows), batch.mask[rows], self.budget, per)

    def _micro_backward(self, batch: TrainBatch, rows: torch.Tensor, advantages: torch.Tensor,
                        logp_prox: torch.Tensor | None, agg: dict | None) -> tuple[dict, torch.Tensor]:
        """One forward and backward on `rows`; `agg`: the loss denominators of the whole update
        (None: these rows are the whole update, the ranks' collective gives them)."""
        a = self.algo
        mask = batch.mask[rows]
        with self.clock.phase("forward"):
            with self.around.capture(batch.attn[rows]):
                logp, entropy = row_token_stats(self.model, batch.input_ids[rows], batch.attn[rows], mask,
                                                batch.targets[rows], self._run(batch, rows), self.temperature,
                                                entropy=bool(a.entropy_coef), chunk_tokens=self.chunk)
            prox = logp.detach() if logp_prox is None else logp_prox
            loss_tok, mask_eff, metrics = self.loss(logp, prox, batch.logp_behav[rows], advantages, mask)
            agg = dict(max_len=self.max_new_tokens, **(self.ranks.denominators(mask_eff) if agg is None else agg))
            loss = losses.aggregate_loss(loss_tok, mask_eff, a.loss_agg, **agg)
            if a.entropy_coef:
                loss = loss - a.entropy_coef * losses.aggregate_loss(entropy, mask_eff, a.loss_agg, **agg)
            if a.kl_coef:
                with torch.no_grad(), self.reference() as ref:
                    ref_logp = self._row_logprobs(ref, batch, rows)
                kl = losses.kl_penalty(logp, ref_logp, a.kl_estimator)
                loss = loss + a.kl_coef * losses.aggregate_loss(kl, mask_eff, a.loss_agg, **agg)
            spec_loss, extra = self.around.extra_loss()
            loss = loss + spec_loss
        with self.clock.phase("backward"):
            self.optimizer.backward(loss)
        return {"loss": float(loss.detach()), **extra, **{k: float(v) for k, v in metrics.items()}}, logp.detach()

    # ---- publishing and checkpoints -----------------------------------------------------------
    def published(self, reason: str = "") -> PublishedVersion | None:
        """The current mean and σ (AdamW: None) as fp32 numpy (what the posterior server stores as its
        next version) with the mean's exact checksum, which every engine checks on receipt; `reason`
        records why it is published (start, kl, ess, staleness); with the slots the noise control chose
        for the version the budget last published (the first version's, before any step, are chosen here) and the noise
        rank. Among R ranks rank 0 returns it, gathered from the owners; the other ranks return None.
        Its time counts as the `publish` phase of the next `clock.take()`."""
        if self.slots is None and not self.step_count:  # the first version: its slots are chosen now
            with self.clock.phase("noise"):
                self.slots = self.noise.plan(self.model, self.optimizer, self.step_count)
        with self.clock.phase("publish"):
            parts = self.optimizer.published()
            if parts is None:
                return None
            mean, sigma = parts
            checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
        return PublishedVersion(learner_step=self.step_count, reason=reason, mean=mean, sigma=sigma,
                                mean_checksum=checksum, slots=None if self.slots is None else tuple(self.slots),
                                noise_rank=self.optimizer.noise_rank, lora=self.optimizer.adapter)

    def save_pretrained(self, directory: str) -> str:
        """The current policy (IVON's mean: p.data holds m outside sampled points) as an HF checkpoint
        of the model's own parameter names; with LoRA the adapters merged, and also as a PEFT adapter
        directory in `directory`/adapter on the base model this learner started from."""
        if not self.lora.rank:
            self.model.save_pretrained(directory)
            return directory
        self.model.save_pretrained(directory, state_dict=merged_weights(self.model))
        save_adapter(self.model, self.lora, os.path.join(directory, "adapter"), self.model_path)
        return directory

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Tensors and metadata of everything needed to continue exactly, asked of each part: the step
        counters, the optimizer's state (this rank's) and VP2O's (services/learner/checkpoint.py writes them)."""
        tensors, meta = self.optimizer.state()
        meta = {"step": self.step_count, "steps_since_sync": self.steps_since_sync, **meta, **self.noise.state()}
        return {**tensors, **self.around.state()}, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Put each part back into the state `state` described."""
        self.step_count, self.steps_since_sync = meta["step"], meta["steps_since_sync"]
        self.noise.load_state(meta)
        self.around.load_state(tensors)
        self.optimizer.load_state({k: v for k, v in tensors.items() if not k.startswith("vp2o/")}, meta)
