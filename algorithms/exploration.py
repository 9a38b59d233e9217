"""Exploration plans as data: which perturbed policies serve a posterior version, which rollouts
form an advantage group, and where the learner takes the gradient (algorithms.md §2.2, §2.3, §2.5;
architecture.md §2.1).

A plan is a frozen `ExplorationPlan` of `Slot`s. Each slot is one policy θ̂ = m + σ ⊙ z(seed): seed
None is the clean mean (σ = 0). For one prompt, every slot produces `rollouts_per_slot` rollouts;
`group_of(slot)` says which of the prompt's `groups_per_prompt` advantage groups (each of
`group_size` rollouts) they join:

| kind | slots | rollouts per slot | groups per prompt × group size | gradient at (each learner update) |
|------|-------|-------------------|--------------------------------|-----------------------------------|
| none | 1, seed None | G | 1 × G | m (no posterior); a fresh θ̂′ with IVON |
| b3po | 1 seeded | G | 1 × G | a fresh θ̂′ |
| m3po | M seeded | G/M (equal compute) or G | M × (G/M) or M × G, a group per slot | a fresh θ̂′_k per slot group (K = M samples) |
| c3po | N seeded | G/N | 1 × G shared by all slots | a fresh θ̂′ |

Seeds come from a stable hash of (base_seed, version, slot) (`param_noise.tensor_seed`, blake2b),
so every process derives the same plan, unless the learner's noise control chose a version's seeds and
σ scale (`noise_seed`, `ExplorationPlan.with_slots`: held to a target KL, a slot over the gate redrawn).
A slot carries a σ multiplier c (`Slot.scale`, θ̂ = m + c · σ ⊙ z): 1 in the plans `make_plan` builds;
`ExplorationPlan.scaled` multiplies it for a re-admitted prompt (dead-group-aware exploration,
services/ledger/ledger.py).
The gradient sample is fresh for every learner update
(`update_seed`, `gradient_points`): a version lives for several learner steps (the sync budget), and
IVON's Price estimate ĥ = λ(h+δ) ε ⊙ ĝ assumes a new ε every step (§1.2), so B3PO and M3PO cannot
reuse their slot's z at the gradient. Synchronous 3PO (§2.2: publish every step) takes B3PO's and
M3PO's gradient at the rollout's own θ̂; here the importance weights correct behaviour (the slot's
θ̂ at its version) → the fresh θ̂′ instead, exactly as C3PO's do. GRPO with IVON keeps the rollouts
at the mean and trains IVON as IVON trains (gradient at a sample; at the mean ĥ = 0 and h decays).

Not here: the noise itself (param_noise.py), advantages (advantages.py), scheduling of slots on
engines (the driver). Action-space baselines (temperature, entropy bonus, clip-higher, KL-Cov) are
loss settings, not plans: see losses.py.
Departures: B3PO/M3PO gradient at a fresh sample instead of the rollout's own (above); the table's
kind names are ours. A plan carries no gradient point: the learner draws one per update.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from threepo.algorithms.param_noise import tensor_seed

KINDS = ("none", "b3po", "m3po", "c3po")


@dataclass(frozen=True)
class Slot:
    """One perturbation slot of a plan: θ̂ = m + c · σ ⊙ z(seed), c = `scale` (the noise control's
    scale, times a re-admission's multiplier: `ExplorationPlan.scaled`); `seed=None` is the clean
    mean (c = 1)."""

    index: int
    seed: int | None
    scale: float = 1.0


@dataclass(frozen=True)
class ExplorationPlan:
    """Slots and grouping of one posterior version (§2.2; table in module doc). `group_size` is the
    size of one advantage group. The gradient point is not the plan's: the learner, which takes
    several steps per version, draws its own for every update (`update_seed`, `gradient_points`)."""

    kind: str
    version: int
    slots: tuple[Slot, ...]
    rollouts_per_slot: int
    group_size: int
    groups_per_prompt: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not self.slots or tuple(s.index for s in self.slots) != tuple(range(len(self.slots))):
            raise ValueError(f"slots must be indexed 0..n-1, got {[s.index for s in self.slots]}")
        if any((s.seed is None) != (self.kind == "none") for s in self.slots):
            need = "seed None (σ = 0)" if self.kind == "none" else "a seed"
            raise ValueError(f"every slot of {self.kind} must have {need}, got {self.slots}")
        if any(not s.scale > 0 or (s.seed is None and s.scale != 1.0) for s in self.slots):
            raise ValueError(f"slot scales must be > 0, and 1 for the mean (seed None), got {self.slots}")
        if self.groups_per_prompt != (len(self.slots) if self.kind == "m3po" else 1):
            raise ValueError(f"groups_per_prompt={self.groups_per_prompt} does not fit {self.kind} "
                             f"with {len(self.slots)} slots")
        if len(self.slots) * self.rollouts_per_slot != self.groups_per_prompt * self.group_size:
            raise ValueError(
                f"slots × rollouts_per_slot = {len(self.slots)} × {self.rollouts_per_slot} must equal "
                f"groups_per_prompt × group_size = {self.groups_per_prompt} × {self.group_size}")

    @property
    def rollouts_per_prompt(self) -> int:
        """Rollouts generated per prompt over all slots (= groups_per_prompt × group_size)."""
        return len(self.slots) * self.rollouts_per_slot

    def scaled(self, scale: float) -> ExplorationPlan:
        """This plan with every slot's σ multiplier c multiplied by `scale`: θ̂_k = m + c · σ ⊙ z(seed_k), same seeds,
        grouping and gradient point. Dead-group-aware exploration serves a re-admitted prompt from it
        (c > 1 where every rollout failed, c < 1 where every rollout passed); the rollouts report
        behaviour log-probs of what was served, and whoever rebuilds a slot uses the same c.
        Raises ValueError for none (σ = 0: there is no noise to scale) unless scale is 1."""
        if scale != 1.0 and self.kind == "none":
            raise ValueError(f"scale={scale}: exploration none serves the mean (σ = 0), there is no noise to scale")
        return dataclasses.replace(self, slots=tuple(Slot(s.index, s.seed, s.scale * scale if s.seed is not None else 1.0)
                                                      for s in self.slots))

    def with_slots(self, slots: list[tuple[int, float]]) -> ExplorationPlan:
        """This plan with each slot's (seed, scale) replaced, grouping unchanged: the learner's noise
        control draws the seeds of a version's slots and sets their scale (`noise_seed`;
        services/learner/noise_control.py). Raises ValueError unless there is one pair per slot."""
        if len(slots) != len(self.slots):
            raise ValueError(f"with_slots: {len(slots)} (seed, scale) pairs for a plan of {len(self.slots)} slots")
        return dataclasses.replace(self, slots=tuple(Slot(i, seed, scale) for i, (seed, scale) in enumerate(slots)))

    def group_of(self, slot_index: int) -> int:
        """Index (within its prompt) of the advantage group that slot `slot_index`'s rollouts join:
        its own index when every slot is its own group (M3PO), else 0 (GRPO, B3PO, C3PO)."""
        if not 0 <= slot_index < len(self.slots):
            raise ValueError(f"slot_index must be in [0, {len(self.slots)}), got {slot_index}")
        return slot_index if self.kind == "m3po" else 0


def plan_seed(base_seed: int, version: int, label: str) -> int:
    """Stable 63-bit seed of one plan entry: blake2b(base_seed, "v<version>/<label>"); label is
    "slot<i>" for slot i. Never Python's per-process `hash`."""
    return tensor_seed(base_seed, f"v{version}/{label}")


def noise_seed(base_seed: int, step: int, slot: int, draw: int) -> int:
    """Seed of draw `draw` of slot `slot` of the version the learner publishes at step `step`, when its
    noise control chooses the seeds (a slot redrawn by the KL gate takes the next draw):
    blake2b(base_seed, "publish<step>/slot<slot>/draw<draw>"), disjoint from `plan_seed`'s and `update_seed`'s labels."""
    return tensor_seed(base_seed, f"publish{step}/slot{slot}/draw{draw}")


def redraw_seed(seed: int, draw: int) -> int:
    """Seed of redraw `draw` ≥ 1 of a slot whose seed is `seed`, when the KL gate finds the slot far
    over its target where it is served (services/sampling/sampler.py): blake2b(seed, "redraw<draw>"). A pure
    function of the slot's own seed, so a sampler redraws without knowing how the seed was chosen."""
    if draw < 1:
        raise ValueError(f"draw must be >= 1 (draw 0 is the slot's own seed), got {draw}")
    return tensor_seed(seed, f"redraw{draw}")


def update_seed(base_seed: int, step: int, update: int, sample: int = 0) -> int:
    """Seed of the gradient sample θ̂′ of learner step `step`, update `update` (epoch × mini-batch
    within the step) and Monte-Carlo sample `sample`: blake2b(base_seed, "learner<step>/u<update>/k<sample>").
    Its label space is disjoint from `plan_seed`'s ("v<version>/..."), so it is never a slot's seed."""
    return tensor_seed(base_seed, f"learner{step}/u{update}/k{sample}")


def gradient_points(kind: str, *, variational: bool, base_seed: int, step: int, update: int,
                    slots: list[int]) -> list[tuple[int | None, list[int]]]:
    """Where one learner update takes its gradient, and on which of its rollouts (module table).

    `slots[i]` is the slot index of the update's i-th rollout. Returns (seed, positions) pairs, one
    per Monte-Carlo sample of the update: seed None is the mean m (only without a posterior,
    `variational=False`, i.e. GRPO with AdamW); otherwise `update_seed(base_seed, step, update, k)`
    with k = 0 for one sample on all rollouts (none, b3po, c3po) and k = the slot index for M3PO,
    one sample per slot group (its groups are one slot each). Raises ValueError for a 3PO kind
    without a posterior.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    everything = list(range(len(slots)))
    if not variational:
        if kind != "none":
            raise ValueError(f"{kind} samples from a posterior: variational must be true")
        return [(None, everything)]
    if kind != "m3po":
        return [(update_seed(base_seed, step, update, 0), everything)]
    return [(update_seed(base_seed, step, update, k), [i for i, s in enumerate(slots) if s == k])
            for k in sorted(set(slots))]


def make_plan(kind: str, *, version: int, base_seed: int, group_size: int, n_slots: int,
              equal_compute: bool = True) -> ExplorationPlan:
    """The plan of posterior version `version` for one 3PO variant or GRPO (§2.2, §2.3, §2.5).

    `group_size` is G, the effective rollouts per prompt; `n_slots` is 1 for none/b3po, M for
    m3po, N for c3po. `equal_compute=False` is M3PO's unconstrained mode (G rollouts per slot).
    Raises ValueError naming the offending argument.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    if kind in ("none", "b3po") and n_slots != 1:
        raise ValueError(f"n_slots must be 1 for {kind}, got {n_slots}")
    if not equal_compute and kind != "m3po":
        raise ValueError(f"equal_compute=False applies to m3po only, got kind={kind!r}")
    if equal_compute and group_size % n_slots:
        raise ValueError(f"group_size={group_size} must be divisible by n_slots={n_slots} for {kind}")
    seeds = [None] if kind == "none" else [plan_seed(base_seed, version, f"slot{i}") for i in range(n_slots)]
    slots = tuple(Slot(i, s) for i, s in enumerate(seeds))
    per_slot = group_size // n_slots if equal_compute else group_size
    groups = n_slots if kind == "m3po" else 1
    return ExplorationPlan(kind=kind, version=version, slots=slots, rollouts_per_slot=per_slot,
                           group_size=n_slots * per_slot // groups, groups_per_prompt=groups)
