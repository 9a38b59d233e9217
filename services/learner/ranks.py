"""The learner's collectives: one rank alone (`SingleRank`, every collective the identity) or one of
R data-parallel ranks over torch.distributed (`Ranks`: gloo on CPU, nccl on GPU).

What the learner does with them (services/learner/core.py; the math of the decomposition is in
algorithms/ivon_shard.py): every rank collates the whole step and computes everything that is
cheap on every row (advantages, the plan of updates, the sync decision), but runs the forward and
backward passes only on its share of each gradient point's groups (`mine`: whole groups, split by
position), with the loss denominators summed over ranks (`denominators`), so the all-reduced
gradients (`all_reduce_grads`) are the gradient of the whole batch's loss. IVON's m, h and momentum
live with the owner of each tensor (`own`, `shard_by_numel`); θ̂ and the new mean reach every
rank's model from the owners (`broadcast_from_owners`). Start-of-step log-probs are summed over
ranks (rows are disjoint, so the sum is exact), so the drift diagnostics and the sync decision are
the same on every rank and equal to one learner's.

A failed collective (a peer died, or `timeout_s` passed) raises `GroupBroken` under gloo: the group
cannot continue, and the caller (deploy/learner_group.py) ends the rank so that the driver sees it
die. Under NCCL (learner.device=cuda) nothing is raised on a timeout: torch's NCCL watchdog ends the
process itself (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default), which the driver sees the same way.

Not here: Ray (deploy/learner_group.py starts the ranks), the optimizer math (algorithms/).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from threepo.algorithms.ivon_shard import shard_by_numel

ADDITIVE_METRICS = ("loss",)  # partial losses with global denominators: their sum is the loss


class GroupBroken(RuntimeError):
    """A collective of the learner ranks failed; the group must be restarted as a whole."""


def share_of(rows: torch.Tensor, group_size: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s share of a gradient point's rows (row r is in group r // group_size): its
    contiguous slice of the point's groups in the order they appear, whole groups, the shares of
    the ranks differing by at most one group."""
    groups = rows // group_size
    ordered = list(dict.fromkeys(groups.tolist()))
    share = np.array_split(np.array(ordered, dtype=np.int64), world)[rank]
    return rows[torch.isin(groups, torch.from_numpy(share))]


def mean_dicts(dicts: list[dict]) -> dict[str, float]:
    return {k: float(np.mean([d[k] for d in dicts])) for k in dicts[0]}


class SingleRank:
    """The learner alone: it owns every tensor and every collective is the identity."""

    rank, world, first = 0, 1, True

    def own(self, named: list) -> list:
        return named

    def mine(self, rows: torch.Tensor, group_size: int) -> torch.Tensor:
        return rows

    def denominators(self, mask: torch.Tensor) -> dict:
        return {}  # aggregate_loss takes its own: the whole point is here

    def sampled(self, opt, named: list, seed: int | None, train: bool, scale: float = 1.0, sigma=None, rank: int = 0):
        return opt.sampled_params(seed, train=train, scale=scale, sigma=sigma, rank=rank)

    def all_reduce_grads(self, named: list) -> None:
        pass

    def broadcast_from_owners(self, named: list) -> None:
        pass

    def share_logprobs(self, start, points) -> None:
        pass

    def point_metrics(self, diag: list[tuple[float, dict]]) -> dict[str, float]:
        return mean_dicts([m for _, m in diag]) if diag else {}

    def gather_objects(self, obj) -> list:
        return [obj]

    def gather_first(self, dicts: list[dict], named: list) -> list[dict] | None:
        return dicts

    def barrier(self) -> None:
        pass


class Ranks:
    """Rank `rank` of `world` learner ranks in one torch.distributed process group, rendezvous at
    `address` ("host:port", served by rank 0). With nccl the small buffers of the collectives go
    through the rank's current CUDA device."""

    def __init__(self, rank: int, world: int, address: str, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.first = dist, rank, world, rank == 0
        self.owner: dict[str, int] = {}
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:  # gloo and nccl raise RuntimeError (or a subclass) for a lost peer
            raise GroupBroken(f"learner rank {self.rank}/{self.world}: a collective failed: {err}") from err

    def abort(self) -> None:
        """Leave the process group, so peers blocked in a collective fail now rather than at the timeout."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def own(self, named: list) -> list:
        self.owner = shard_by_numel([(n, p.numel()) for n, p in named], self.world)
        return [(n, p) for n, p in named if self.owner[n] == self.rank]

    def mine(self, rows: torch.Tensor, group_size: int) -> torch.Tensor:
        return share_of(rows, group_size, self.rank, self.world)

    def denominators(self, mask: torch.Tensor) -> dict:
        counts = torch.tensor([float(mask.sum()), float((mask.sum(dim=1) > 0).sum())], dtype=torch.float64,
                              device=self.device)
        with self._collective():
            self.dist.all_reduce(counts)
        return {"num_tokens": float(counts[0]), "num_seqs": float(counts[1])}

    @contextlib.contextmanager
    def sampled(self, opt, named: list, seed: int | None, train: bool, scale: float = 1.0,
                sigma=None, rank: int = 0) -> Iterator[None]:
        """Every rank's model at θ̂(seed, scale) (the owners' tensors, broadcast; `sigma`: the owners'
        σ to build it with, default the posterior's; `rank`: z's rank per matrix, 0 full); with
        train=True the body's gradients are summed over ranks before IVON folds its own tensors' share in."""
        with opt.sampled_params(seed, train=train, scale=scale, sigma=sigma, rank=rank):
            self.broadcast_from_owners(named)
            yield
            if train:
                self.all_reduce_grads(named)
        self.broadcast_from_owners(named)
        for _, p in named:
            p.grad = None

    def all_reduce_grads(self, named: list) -> None:
        """p.grad ← Σ_r p.grad (None counts as zeros), one flat bucket."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [torch.zeros_like(p) if p.grad is None else p.grad for _, p in named]
        flat = _flatten_dense_tensors(grads)
        with self._collective():
            self.dist.all_reduce(flat)
        for (_, p), g in zip(named, _unflatten_dense_tensors(flat, grads)):
            p.grad = g

    @torch.no_grad()
    def broadcast_from_owners(self, named: list) -> None:
        """Every tensor's p.data from its owner: one flat bucket per owner."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for src in range(self.world):
            params = [p for n, p in named if self.owner[n] == src]
            flat = _flatten_dense_tensors([p.data for p in params])
            with self._collective():
                self.dist.broadcast(flat, src=src)
            if src != self.rank:
                for p, t in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.copy_(t)

    def share_logprobs(self, start, points: Sequence[tuple[tuple, torch.Tensor]]) -> None:
        """Complete `start` (services/learner/proximal.py) on the rows of each (point, rows) from the ranks that
        computed them (each row on one rank, zeros elsewhere: the sum is exact)."""
        for point, rows in points:
            if len(rows):
                part = start.logp[point][rows].to(self.device)
                with self._collective():
                    self.dist.all_reduce(part)
                start.logp[point][rows] = part.to(start.logp[point].device)
                start.have[point][rows] = True

    def point_metrics(self, diag: list[tuple[float, dict]]) -> dict[str, float]:
        """Mean over the step's gradient points of each point's metrics: over ranks, the loss summed
        and the rest weighted by each rank's completion tokens (exact for per-token means)."""
        every = self.gather_objects(diag)
        points = []
        for per_rank in zip(*every):
            present = [(w, m) for w, m in per_rank if m]
            if not present:
                continue
            total = sum(w for w, _ in present) or 1.0
            points.append({k: sum(m[k] for _, m in present) if k in ADDITIVE_METRICS
                           else sum(w * m[k] for w, m in present) / total for k in present[0][1]})
        return mean_dicts(points) if points else {}

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        with self._collective():
            self.dist.all_gather_object(out, obj)
        return out

    def gather_first(self, dicts: list[dict], named: list) -> list[dict] | None:
        """`dicts` ({name: tensor} of this rank's tensors, e.g. m and σ) on rank 0, whole and in model
        order, sent by each owner in one flat message; None on the other ranks."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if not self.first:
            own = [d[n] for n, _ in named if self.owner[n] == self.rank for d in dicts]
            with self._collective():
                self.dist.send(_flatten_dense_tensors(own).to(self.device), dst=0)
            return None
        out = [{} for _ in dicts]
        for src in range(1, self.world):
            like = [torch.empty(p.shape, dtype=torch.float32) for n, p in named if self.owner[n] == src
                    for _ in dicts]
            flat = torch.empty(sum(t.numel() for t in like), dtype=torch.float32, device=self.device)
            with self._collective():
                self.dist.recv(flat, src=src)
            got = iter(_unflatten_dense_tensors(flat.cpu(), like))
            for n, _ in ((n, p) for n, p in named if self.owner[n] == src):
                for d in out:
                    d[n] = next(got)
        for n, _ in named:
            for d, mine in zip(out, dicts):
                if self.owner[n] == 0:
                    d[n] = mine[n]
        return [{n: d[n] for n, _ in named} for d in out]

    def barrier(self) -> None:
        with self._collective():
            self.dist.barrier()
