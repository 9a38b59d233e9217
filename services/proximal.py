"""Token log-probs at the start of a learner step, kept per gradient point (the learner's π_prox).

Every optimizer update of a step compares π_θ with the policy at the start of the step at that
update's gradient point θ̂′ = m₀ + σ₀ ⊙ z(seed) (seed None: the mean), and the sync budget compares
each rollout's behaviour log-probs with its own slot rebuilt from (m₀, σ₀) and the slot's σ
multiplier c (θ̂ = m₀ + c · σ₀ ⊙ z(seed); gradient points have c = 1). The learner computes
these once, before the weights move, row by row into one [B, T] tensor per seed; rows asked for
twice are computed once; `Beside` computes those only the drift diagnostic needs on a copy of the
model in a thread of its own, beside the update's gradient (and draws the next step's gradient
noise there), and `drift_metrics` compares them with the behaviour log-probs. Not here: what each
forward computes (services/learner.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from threepo.algorithms import off_policy
from threepo.algorithms.param_noise import load_perturbed, noise_like


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


def drift_sample(points: list, sample: int, *, step: int, seed: int) -> torch.Tensor:
    """Rows on which the drift diagnostic is measured: a seeded sample of `sample` rows of one
    (slot seed, scale) point, the point rotating with `step` (`sample` 0: every row)."""
    if not sample:
        return torch.arange(len(points))
    distinct = sorted(set(points), key=lambda p: (p[0] is None, p[0] or 0, p[1]))
    chosen = distinct[step % len(distinct)]
    rows = torch.tensor([r for r, p in enumerate(points) if p == chosen])
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return rows[torch.randperm(len(rows), generator=gen)[:sample]].sort().values


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


class Pending:
    """Start-of-step log-probs being computed beside the update; `join` waits for them and files
    them into the step's `StartLogprobs` (once; a later join does nothing), and keeps the noise
    drawn ahead for a later gradient point in `ahead` ((seed, {name: z}) or None). Errors propagate."""

    def __init__(self, future: Future | None = None) -> None:
        self.future, self.ahead = future, None

    def join(self, start: StartLogprobs) -> None:
        if self.future is not None:
            future, self.future = self.future, None
            results, self.ahead = future.result()
            for (seed, scale), rows, logp in results:
                start.put(seed, rows, logp, scale)


class Beside:
    """No-grad forwards at start-of-step posterior samples on a copy of the learner's model, in a
    thread of their own, so that they run while the main thread computes the update's gradient (on
    a CPU box, in a core's idle time; the result does not depend on timing). It takes the points
    only the drift diagnostic needs; (m, σ) are read as they are when `start` is called, and the
    learner joins before its first optimizer step changes them."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.model = copy.deepcopy(model).requires_grad_(False)
        params = dict(self.model.named_parameters())
        self.named = [(n, params[n]) for n in names]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="learner-beside")

    def start(self, logprobs: Callable, batch, points: dict, opt, ahead: int | None = None) -> Pending:
        """Computes `logprobs(batch, rows, model)` at θ̂(seed, c) from IVON `opt`'s current (m, σ) for
        each ((seed, c), rows) of `points`, on this copy of the model, in the thread; then, with
        `ahead`, draws z(ahead, name) of every parameter for a gradient point to come."""
        means, sigmas = opt.mean_by_name(), opt.sigma_by_name()

        def work() -> tuple[list, tuple | None]:
            torch.set_flush_denormal(True)  # per thread, as the learner's own
            out = []
            with torch.no_grad():
                for (seed, scale), rows in points.items():
                    load_perturbed(self.named, means, sigmas, seed, scale)
                    out.append(((seed, scale), rows, logprobs(batch, rows, self.model)))
            noise = None if ahead is None else (ahead, {n: noise_like(ahead, n, p.shape) for n, p in self.named})
            return out, noise
        return Pending(self.pool.submit(work))
