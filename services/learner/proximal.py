"""Token log-probs at the start of a learner step, kept per gradient point (the learner's π_prox).

Every optimizer update of a step compares π_θ with the policy at the start of the step at that
update's gradient point θ̂′ = m₀ + σ₀ ⊙ z(seed) (seed None: the mean), and the sync budget compares
each rollout's behaviour log-probs with its own slot rebuilt from (m₀, σ₀) and the slot's σ
multiplier c (θ̂ = m₀ + c · σ₀ ⊙ z(seed); gradient points have c = 1). The learner computes
these once, before the weights move, row by row into one [B, T] tensor per seed; rows asked for
twice are computed once (those only the drift diagnostic needs can be computed by a process beside
the update: services/learner/drift_process.py), and `drift_metrics` compares them with the behaviour log-probs.
Not here: what each forward computes (services/learner/core.py).
"""

from __future__ import annotations

import torch

from threepo.algorithms import off_policy


class StartLogprobs:
    """Token log-probs [B, T] at the start-of-step weights, per point (seed, σ multiplier), filled row by row."""

    def __init__(self, shape: torch.Size, device: torch.device | str = "cpu") -> None:
        self.shape, self.device, self.logp, self.have = shape, device, {}, {}

    def put(self, seed: int | None, rows: torch.Tensor, logp: torch.Tensor, scale: float = 1.0) -> None:
        point = (seed, scale)
        self.logp.setdefault(point, torch.zeros(self.shape, device=self.device))[rows] = logp
        self.have.setdefault(point, torch.zeros(self.shape[0], dtype=torch.bool))[rows] = True

    def get(self, seed: int | None, rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
        """The rows' log-probs at (`seed`, `scale`), or None if some were not computed."""
        point = (seed, scale)
        done = point in self.have and bool(self.have[point][rows].all())
        return self.logp[point][rows] if done else None

    def first(self, updates: list) -> torch.Tensor:
        """[B, T]: each row's π_prox at its first update (rows in no update stay 0)."""
        out, done = torch.zeros(self.shape, device=self.device), torch.zeros(self.shape[0], dtype=torch.bool)
        for seed, rows in (point for points in updates for point in points):
            fresh = rows[~done[rows]]
            out[fresh], done[fresh] = self.logp[(seed, 1.0)][fresh], True
        return out


def drift_sample(points: list, sample: int | None, *, step: int, seed: int, group_size: int) -> torch.Tensor:
    """Rows on which the drift diagnostic is measured: `sample` rows of one (slot seed, scale) point,
    the point rotating with `step`, in pairs of rows of one group (two rollouts of one prompt, whose
    prompt the shared-prefix forward computes once) from groups drawn at random (seeded by `seed` and
    `step`), a single row where a group holds one of the point's; `sample` None: every row. Rows are
    [B] in groups of `group_size` consecutive rows."""
    if sample is None:
        return torch.arange(len(points))
    distinct = sorted(set(points), key=lambda p: (p[0] is None, p[0] or 0, p[1]))
    chosen = distinct[step % len(distinct)]
    by_group: dict[int, list[int]] = {}
    for r, p in enumerate(points):
        if p == chosen:
            by_group.setdefault(r // group_size, []).append(r)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    groups, rows = sorted(by_group), []
    for g in torch.randperm(len(groups), generator=gen).tolist():
        rows += by_group[groups[g]][:2]
        if len(rows) >= sample:
            break
    return torch.tensor(sorted(rows[:sample]))


def drift_metrics(batch, start: StartLogprobs, updates: list, measured: torch.Tensor) -> dict:
    """Behaviour μ against (a) each measured rollout's own slot rebuilt at the start-of-step
    (m, σ) with its own σ multiplier: the drift the sync budget acts on (`*_drift`; on the
    learner's `_drift_rows` sample), and (b) the π_prox of its first update (what the
    importance weights correct to: drift plus the noise between z and z′; updated rows only;
    a step without an update reports the drift values there). A step that measured no drift
    reports (b) only."""
    out = {} if not len(measured) else _slot_drift(batch, start, measured)
    if updates:
        rows = torch.unique(torch.cat([rows for points in updates for _, rows in points]))
        total = off_policy.behaviour_drift(start.first(updates)[rows], batch.logp_behav[rows], batch.mask[rows])
        out.update(kl_k3=float(total["kl_k3"]), ess_frac=float(total["ess_frac"]))
    return out


def _slot_drift(batch, start: StartLogprobs, measured: torch.Tensor) -> dict:
    points = [(batch.slot_seeds[r], batch.slot_scales[r]) for r in measured.tolist()]
    same_slot = torch.zeros_like(batch.logp_behav[measured])
    for seed, scale in set(points):
        at = torch.tensor([i for i, x in enumerate(points) if x == (seed, scale)])
        same_slot[at] = start.get(seed, measured[at], scale)
    drift = off_policy.behaviour_drift(same_slot, batch.logp_behav[measured], batch.mask[measured])
    return {"kl_k3_drift": float(drift["kl_k3"]), "ess_frac_drift": float(drift["ess_frac"]),
            "kl_k3": float(drift["kl_k3"]), "ess_frac": float(drift["ess_frac"])}
