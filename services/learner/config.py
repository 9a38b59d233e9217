"""Configuration of the learner: the algorithm (exploration × advantage × correction), how the
learner runs (ranks, device, precision) and VP2O's settings; the optimizer and the sync budget are in
services/learner/optim_config.py. Each is a frozen dataclass with a docstring per field; contradictory
combinations are rejected by `check_combination` and `check_learner` before anything starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from threepo.services.learner.optim_config import OptimConfig


@dataclass(frozen=True)
class AlgoConfig:
    """What is optimised. Any exploration composes with any advantage, correction and loss."""

    exploration: Literal["none", "b3po", "m3po", "c3po"] = "c3po"
    """Parameter-space exploration (algorithms.md §2): none = rollouts at the mean (σ = 0: plain GRPO-style action-space sampling); b3po =
    one posterior sample per version; m3po = M samples, each its own group; c3po = N samples sharing
    one group. The gradient is at a fresh posterior sample θ̂′ for every update (m3po: one per slot
    group), also for none with optim.name=ivon (IVON's training rule: at the mean its Hessian
    estimate is 0 and h only decays); none with AdamW takes it at the mean."""
    advantage: Literal["grpo", "dr_grpo", "lampo"] = "grpo"
    """Advantage estimator: std-normalised (grpo), mean-centred (dr_grpo), pairwise (lampo, §4.1)."""
    group_size: int = 16
    """Rollouts in one advantage group (G)."""
    n_slots: int = 4
    """Perturbation slots per version: N of C3PO, M of M3PO (1 for none and b3po)."""
    equal_compute: bool = True
    """M3PO only: G/M rollouts per slot (true) or G per slot (false, M× the rollouts)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation (§0.2); Dr.GRPO pairs with seq-mean-token-sum-norm."""
    loss: Literal["ppo", "decoupled_ppo", "kl_cov"] = "ppo"
    """Policy loss (algorithms.md §0.1, §5.4, §5.5): ppo = clipped surrogate on π_θ/π_prox times the
    `is_correction` weights π_prox/μ; decoupled_ppo = AReaL's, the token weights π_prox/μ built in
    and tokens above `is_cap` masked out (needs is_correction = none); kl_cov = KL-Cov, no clip,
    |log π_θ/π_prox| penalty on the top `kl_cov_ratio` tokens by covariance. π_prox is the policy at
    the start of the step at the update's gradient point."""
    ppo_epochs: int = 1
    """Passes over the step's batch. Each pass takes `mini_batches` optimizer steps."""
    mini_batches: int = 1
    """Optimizer steps per pass, each on a contiguous share of the batch's groups (whole groups).
    With ppo_epochs = mini_batches = 1 (3PO's setting, §7) the only update starts at π_prox, so the
    ratio is 1 and eps_low, eps_high, dual_clip_c and KL-Cov's penalty act on nothing; later
    updates of a step see ratios ≠ 1 (the policy moved, the noise realisation z′ is the same on both
    sides) and the clips act. With IVON every update is one IVON step at a fresh θ̂′. On the embedded
    default (C3PO, 200 steps, two seeds) 1 × 2 and 2 × 1 learned no differently from 1 × 1 (held-out
    pass@1 0.46 → 0.54 ± 0.02 for each), so the default keeps one update per step."""
    eps_low: float = 0.2
    """PPO clip range below 1 (ppo, decoupled_ppo; changing it needs more than one update)."""
    eps_high: float = 0.2
    """PPO clip range above 1 (clip-higher baseline: 0.28 to 0.5; needs more than one update)."""
    dual_clip_c: float = 0.0
    """Dual clip constant c > 1 for negative advantages (0 = off; needs more than one update)."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: share of valid tokens penalised (verl's default; 3PO's baseline used 0.2)."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of the |log π_θ/π_prox| penalty."""
    dynamic_filter: bool = False
    """DAPO dynamic filter (§5.3): groups whose rewards are all equal are left out of the update
    (counted in `filtered_groups`); a step with none left takes no optimizer step. The driver's
    ledger also drops such prompts (all of a prompt's groups equal on the verifier's reward, DAPO's
    accuracy criterion) before the step takes them and admits others in their place, so a step keeps
    `runtime.prompts_per_step` informative prompts where `filter_replacements` allows."""
    filter_replacements: float = 1.0
    """dynamic_filter only: most prompts the ledger drops and replaces per learner step, as a fraction
    of runtime.prompts_per_step (⌈fraction · B⌉; DAPO's bound is max_num_gen_batches). Past it,
    equal-reward groups reach the learner, whose filter leaves them out. Each replacement costs one
    prompt's rollouts more. 0 = no replacements."""
    readmit_fraction: float = 0.0
    """Dead-group-aware exploration: most re-admitted prompts among any step's prompts, as a fraction
    of runtime.prompts_per_step (⌈fraction · B⌉; 0 = off). A prompt whose rollouts all failed is
    admitted again as a new group (an admission of a later step, in place of a fresh prompt) with
    every slot's σ × `dead_group_scale`; one whose rollouts all passed, with σ × `solved_group_scale`
    if that is not 1. The rollouts report behaviour log-probs of the scaled slots, so the off-policy
    correction is exact, and the learner's drift diagnostic rebuilds each slot with its scale."""
    readmit_max: int = 1
    """Most re-admissions of one prompt."""
    dead_group_scale: float = 1.0
    """σ multiplier c of a re-admitted all-fail prompt's slots (θ̂ = m + c · σ ⊙ z; 1 = the same σ, a
    plain retry — the only kind exploration none, which serves the mean, has)."""
    solved_group_scale: float = 1.0
    """σ multiplier of a re-admitted all-pass prompt's slots; 1 = all-pass prompts are not re-admitted."""
    is_correction: Literal["none", "token_tis", "seq_tis", "seq_mis", "token_mis"] = "token_tis"
    """Off-policy correction π_prox/μ against each rollout's own behaviour log-probs (§5.6): truncated
    (tis: weights capped at `is_cap`) or masked (mis: sequences or tokens above it rejected), per token
    or per sequence. Token-level by default: PSN-RLVR found parameter noise without a correction worse
    than GRPO and better with a capped token-level one (a product over a sequence's tokens caps almost
    every sequence once slots differ from the gradient point). The share capped is `is_clip_frac`, the
    effective sample size `ess_frac`."""
    is_cap: float = 2.0
    """Truncation / rejection threshold C of the importance weights."""
    entropy_coef: float = 0.0
    """Entropy bonus c_H (action-space baseline: 5e-3)."""
    kl_coef: float = 0.0
    """KL penalty β to the reference (initial) policy."""
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k2+", "k3+"] = "k3"
    """KL estimator of the penalty (§0.3)."""
    lampo_tau: float = 1.5
    """LamPO temperature τ of the pairwise confidence weight."""
    lampo_seq_logp: Literal["sum", "mean"] = "sum"
    """LamPO sequence log-prob: summed or length-normalised, under π_prox recomputed by the learner
    (one policy for a whole group, never the N slots' behaviour log-probs)."""
    lampo_lam_sem: float = 0.1
    """LamPO λ_sem: weight of the ROUGE-L reward against the item's reference solution."""
    vp2o: bool = False
    """VP2O Stein updates over MoE experts (needs model.kind = moe)."""
    seed: int = 0
    """Seed of the learner's fresh gradient samples θ̂′; in a run, the run's `seed` unless set."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"algo.group_size: expected >= 2 (a baseline needs two), got {self.group_size}")
        if self.n_slots < 1:
            raise ValueError(f"algo.n_slots: expected >= 1, got {self.n_slots}")
        if self.exploration in ("none", "b3po") and self.n_slots != 1:
            raise ValueError(f"algo.n_slots={self.n_slots}: {self.exploration} uses one slot; set algo.n_slots=1")
        if not self.equal_compute and self.exploration != "m3po":
            raise ValueError(f"algo.equal_compute=false: M3PO's unconstrained mode (G rollouts per slot), not "
                             f"{self.exploration}'s; set algo.exploration=m3po or leave algo.equal_compute=true")
        divides = self.exploration == "c3po" or (self.exploration == "m3po" and self.equal_compute)
        if divides and self.group_size % self.n_slots:
            raise ValueError(f"algo.group_size={self.group_size}: expected a multiple of algo.n_slots="
                             f"{self.n_slots} for {self.exploration}")
        if self.is_cap <= 1.0 and self.is_correction != "none":
            raise ValueError(f"algo.is_cap: expected > 1, got {self.is_cap}")
        if self.dual_clip_c and self.dual_clip_c <= 1.0:
            raise ValueError(f"algo.dual_clip_c: expected 0 (off) or > 1, got {self.dual_clip_c}")
        if self.lampo_tau <= 0:
            raise ValueError(f"algo.lampo_tau: expected > 0, got {self.lampo_tau}")
        self._check_loss()
        self._check_readmission()

    def _check_readmission(self) -> None:
        """Reject re-admission and replacement settings that would silently do nothing."""
        if not 0.0 <= self.readmit_fraction <= 1.0:
            raise ValueError(f"algo.readmit_fraction: expected in [0, 1], got {self.readmit_fraction}")
        if not isinstance(self.readmit_max, int) or self.readmit_max < 1:
            raise ValueError(f"algo.readmit_max: expected an integer >= 1, got {self.readmit_max!r}")
        for name in ("dead_group_scale", "solved_group_scale"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"algo.{name}: expected > 0 (a σ multiplier), got {value}")
            if value != 1.0 and self.exploration == "none":
                raise ValueError(f"algo.{name}={value}: exploration none serves the mean (σ = 0), there is no noise to scale")
        changed = [n for n in ("readmit_max", "dead_group_scale", "solved_group_scale")
                   if getattr(self, n) != 1]
        if changed and not self.readmit_fraction:
            raise ValueError(f"algo.{changed[0]}: prompts are re-admitted only with algo.readmit_fraction > 0")
        if self.filter_replacements < 0:
            raise ValueError(f"algo.filter_replacements: expected >= 0, got {self.filter_replacements}")
        if self.filter_replacements != 1.0 and not self.dynamic_filter:
            raise ValueError("algo.filter_replacements: only used with algo.dynamic_filter=true")

    def _check_loss(self) -> None:
        """Reject loss settings that would silently do nothing (see the fields' docstrings)."""
        if self.loss not in ("ppo", "decoupled_ppo", "kl_cov"):
            raise ValueError(f"algo.loss: expected ppo, decoupled_ppo or kl_cov, got {self.loss!r}")
        for name in ("ppo_epochs", "mini_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"algo.{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.loss == "decoupled_ppo" and self.is_correction != "none":
            raise ValueError("algo.loss=decoupled_ppo weights tokens by π_prox/μ itself (masked above "
                             f"algo.is_cap): set algo.is_correction=none (got {self.is_correction})")
        defaults = {f.name: f.default for f in dataclasses.fields(AlgoConfig)}
        changed = [n for n in ("eps_low", "eps_high", "dual_clip_c") if getattr(self, n) != defaults[n]]
        if changed and self.loss == "kl_cov":
            raise ValueError(f"algo.{changed[0]}: algo.loss=kl_cov has no clip; leave it at {defaults[changed[0]]}")
        if changed and self.ppo_epochs * self.mini_batches == 1:
            raise ValueError(f"algo.{changed[0]}: with one update per step the ratio π_θ/π_prox is 1 and the "
                             "clip never acts; set algo.mini_batches or algo.ppo_epochs > 1")
        unused = [n for n in ("kl_cov_ratio", "kl_cov_coef") if getattr(self, n) != defaults[n]]
        if unused and self.loss != "kl_cov":
            raise ValueError(f"algo.{unused[0]}: only used by algo.loss=kl_cov (got loss={self.loss})")
        if not 0.0 <= self.kl_cov_ratio <= 1.0 or self.kl_cov_coef < 0:
            raise ValueError("algo.kl_cov_ratio in [0, 1] and algo.kl_cov_coef >= 0 expected")


@dataclass(frozen=True)
class LearnerConfig:
    """How the learner runs: one process, or R data-parallel ranks (services/learner/ranks.py;
    deploy/learner_group.py starts them as Ray actors in one placement group)."""

    ranks: int = 1
    """Data-parallel learner ranks, one Ray actor each (`runtime.learner_cpus` CPUs). Every rank runs
    the forward and backward passes of its share of each step's groups; gradients are summed over
    ranks; IVON's m, h and momentum are sharded by parameter name (≈ 1/R of the state per rank);
    AdamW's state is whole on every rank unless `deepspeed_stage` shards it. Each rank writes its
    own part of a checkpoint, which any number of ranks (1 included) can load."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend among the ranks: auto = nccl on `device=cuda`, gloo on cpu."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the learner computes; cuda gives each rank one GPU (Ray `num_gpus=1`)."""
    deepspeed_stage: int = -1
    """AdamW only: train the model through a DeepSpeed engine with this ZeRO stage (0-3; 2 shards
    optimizer state and gradients, 3 also the parameters); -1 = without DeepSpeed. IVON does not go
    through DeepSpeed: its perturbation θ̂ = m + σ ⊙ z(seed, name) is per parameter tensor, and
    ZeRO-1/2/3 hand the optimizer flat partitions instead (architecture.md §9); its own
    state is sharded by name here instead. Needs `pip install 'threepo[deepspeed]'`."""
    shared_prefix: bool = True
    """Compute each group's prompt once and run only the completions on its repeated KV cache (the
    same logits and gradients as a plain forward, to fp32 rounding; about half the learner's work
    when prompts are as long as completions). VP2O's routing hooks keep the plain forward."""
    drift_process: bool = True
    """IVON on one CPU rank: run the drift diagnostic's no-grad forward at a slot (the sync budget's
    KL and ESS) in a process of its own beside the update (services/learner/drift_process.py), on a core the
    samplers leave idle, instead of on the learner's. It holds a second copy of the model; until it
    has loaded it (seconds) the learner computes those forwards itself. false: always itself. A
    local run with a fixed sampler pool starts it only where a core is left beside the learner's
    and the samplers' CPUs (deploy/cores.py `drift_process`; the driver says when it does not: on 2
    cores with one sampler the process would slow the engine more than it spares the learner)."""
    timeout_s: float = 300.0
    """Longest wait of one collective: a rank that stops answering fails the group after this, and
    the driver restores the learner from the latest checkpoint (a dead rank fails it at once)."""
    activation_mb: int | Literal["off"] = 1024
    """Memory (MiB) one forward and backward may hold for activations, by an estimate from the
    model's config: each update's rows are split into micro-batches of whole prompt runs that fit
    (gradients accumulated, loss denominators those of the whole update, so the step is the same),
    and the output head runs on at most a quarter of it of logits at a time; `off`: never split. The
    embedded model's steps fit in one micro-batch; a 135M model's take ~600 positions each."""
    bf16: bool = False
    """Mixed precision: the forward and backward passes' matmuls in bfloat16 (torch.autocast), the
    weights, gradients and optimizer state in fp32. About 2x the learner's speed on a CPU with
    bf16 instructions (AVX-512 BF16, AMX) and on GPUs; log-probs then agree with the engines' to
    ~1e-2 instead of 1e-6, which the importance weights correct like any other mismatch."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' gradient checkpointing): ~1/15 of the activation memory per token for ~1/3 more
    compute, so micro-batches hold more rows."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"learner.ranks: expected >= 1, got {self.ranks}")
        if self.activation_mb != "off" and self.activation_mb < 1:
            raise ValueError(f"learner.activation_mb: expected MiB >= 1, or \"off\" (never split), got "
                             f"{self.activation_mb}")
        if self.deepspeed_stage not in (-1, 0, 1, 2, 3):
            raise ValueError(f"learner.deepspeed_stage: expected -1 (off) or a ZeRO stage 0-3, got {self.deepspeed_stage}")
        if self.timeout_s <= 0:
            raise ValueError(f"learner.timeout_s: expected > 0, got {self.timeout_s}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("learner.backend=nccl needs learner.device=cuda")

    @property
    def resolved_backend(self) -> str:
        return {"auto": "nccl" if self.device == "cuda" else "gloo"}.get(self.backend, self.backend)

    @property
    def grouped(self) -> bool:
        """Whether the learner runs as a group of ranks (a process group) rather than one actor."""
        return self.ranks > 1 or self.deepspeed_stage >= 0


def has_drift_process(optim: str, ranks: int, deepspeed_stage: int, device: str, lora_rank: int = 0) -> bool:
    """Whether a learner runs the drift diagnostic's forward in a process beside its update when
    `learner.drift_process` asks for it: IVON on one CPU rank without DeepSpeed (on a GPU the
    process's model copy would cost device memory for a forward that is small there) or LoRA (the
    process loads the model without adapters)."""
    return optim == "ivon" and ranks == 1 and deepspeed_stage < 0 and device == "cpu" and not lora_rank


def check_learner(learner: LearnerConfig, algo: AlgoConfig, optim: OptimConfig) -> None:
    """Reject what a group of learner ranks cannot do, naming the keys to change."""
    if learner.deepspeed_stage >= 0 and optim.name != "adamw":
        raise ValueError(f"learner.deepspeed_stage={learner.deepspeed_stage}: only optim.name=adamw trains through "
                         "DeepSpeed (IVON's state is sharded by parameter name without it); set learner.deepspeed_stage=-1")
    if learner.ranks > 1 and algo.vp2o:
        raise ValueError("algo.vp2o=true runs on one learner rank (its Stein terms couple all experts): set learner.ranks=1")
    if learner.ranks > 1 and algo.loss == "kl_cov":
        raise ValueError("algo.loss=kl_cov selects its tokens over the whole batch: set learner.ranks=1 "
                         "or another algo.loss")


def check_combination(algo: AlgoConfig, optim: OptimConfig, model_kind: str) -> None:
    """Reject combinations that cannot work, naming the keys to change."""
    if algo.exploration != "none" and optim.name != "ivon":
        raise ValueError(f"algo.exploration={algo.exploration} samples policies from the IVON posterior: "
                         f"set optim.name=ivon (got {optim.name})")
    if algo.vp2o and model_kind != "moe":
        raise ValueError("algo.vp2o=true needs a mixture-of-experts model: set model.kind=moe")


@dataclass(frozen=True)
class VP2OConfig:
    """VP2O coefficients (defaults from algorithms.md §7)."""

    alpha_att: float = 1.0
    """Attraction weight α_att in [0, 1]: 1 = pure kernel-weighted averaging over A(i) ∪ {i} (§3.5)."""
    gamma_rep: float = 1e-3
    """Repulsion coefficient γ_rep ≥ 0 on ∇L_rep, added to down_proj's grad only (§3.5)."""
    lambda_orth: float = 1e-3
    """Weight λ_orth ≥ 0 of the expert orthogonalisation loss L_orth (§3.6)."""
    lambda_div: float = 1e-3
    """Weight λ_div ≥ 0 of the routing diversification loss L_div (§3.6)."""
    lift_hi: float = 1.25
    """Co-activation lift at or above which two experts attract (§3.4), relative to a router picking
    its top-k sets uniformly at random (`algorithms.moe.chance_lift`). A top-k-of-E router's raw lift
    is at most E/K — 2 for the tiny MoE's top-2 of 4, where §3.4's absolute 2.0 attracted nothing
    and the largest relative lift of a layer at initialisation is 1.2–2.0 (4 seeds, random and task
    tokens); the embedded MoE's top-2 of 8 reaches 2–10."""
    lift_lo: float = 0.5
    """Co-activation lift at or below which two experts repel (§3.4), relative to chance like
    lift_hi; must be < lift_hi."""
    beta_co: float = 0.9
    """EMA factor β_co in [0, 1) of the load and co-activation statistics (§3.4)."""
    anchor_budget: float = math.sin(0.05) ** 2
    """Anchor prototype budget B_anc on 1 − ⟨p, p_anc⟩² (§3.7)."""
    power_iters: int = 2
    """Warm-started power iterations per step for the prototypes (§3.2)."""
    sync_power_iters: int = 32
    """Power iterations when (re)setting the anchors: at construction and on_sync."""
    n_bisect: int = 3
    """Bisection steps of the per-expert step shrinking (§3.7)."""
    h_min: float = 1e-4
    """Lower bound of the kernel bandwidth (§3.3)."""
    seed: int = 0
    """Seed of the random power-iteration start (layer i uses seed + i); in a run, the run's `seed`
    unless set."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha_att <= 1.0:
            raise ValueError(f"vp2o.alpha_att: expected in [0, 1], got {self.alpha_att}")
        for name in ("gamma_rep", "lambda_orth", "lambda_div"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"vp2o.{name}: expected ≥ 0, got {getattr(self, name)}")
        if not self.lift_lo < self.lift_hi:
            raise ValueError(f"vp2o.lift_lo/lift_hi: expected lift_lo < lift_hi, got {self.lift_lo}, {self.lift_hi}")
        if not 0.0 <= self.beta_co < 1.0:
            raise ValueError(f"vp2o.beta_co: expected in [0, 1), got {self.beta_co}")
        if not 0.0 < self.anchor_budget <= 1.0:
            raise ValueError(f"vp2o.anchor_budget: expected in (0, 1], got {self.anchor_budget}")
        for name in ("power_iters", "sync_power_iters", "n_bisect"):
            if getattr(self, name) < 0:
                raise ValueError(f"vp2o.{name}: expected ≥ 0, got {getattr(self, name)}")
        if not self.h_min > 0.0:
            raise ValueError(f"vp2o.h_min: expected > 0, got {self.h_min}")
