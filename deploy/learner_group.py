"""The learner as R data-parallel ranks: Ray actors in one placement group, one torch.distributed
process group among them (services/learner/ranks.py), behind the single learner's methods.

`LearnerGroup` is what the driver holds as `roles.learner` when `learner.ranks > 1` (or DeepSpeed is
on): `step`, `published`, `save_checkpoint` and `save_hf` each take `.remote(...)` like the methods
of one `LearnerActor` and return one ObjectRef, rank 0's. Every call goes to every rank in the same
order (each rank receives the step's batch references and fetches the rows itself; nothing passes
through the driver), and each call's collectives make rank 0 answer only when the group's work is
done: a step after the gradients were summed and the shards stepped, `published` with m and σ
gathered from their owners, `save_checkpoint` after every rank wrote its shard (a barrier).

A rank that dies fails the group: the others' collectives raise `GroupBroken`, and a rank whose
collective failed ends its process, so rank 0's reference raises `ActorDiedError` on the driver —
`RoleLost`, and the driver restores the learner and the posterior server from the latest checkpoint
(`start_stateful`), the whole group with the same (or any) number of ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from threepo.deploy.learner_actor import LearnerActor


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits in the group."""

    rank: int
    world: int
    backend: str
    timeout_s: float


def free_address() -> str:
    """host:port for the group's rendezvous, on the node this runs on (rank 0's bundle)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


class LearnerRankActor:
    """One rank: joins the process group at `address`, then holds a `LearnerActor` whose learner
    uses it (only rank 0 records metrics and the rollout log)."""

    def __init__(self, spec: RankSpec, address: str, model_path: str, *args, rollout_log: str = "",
                 **kwargs) -> None:
        from threepo.services.learner.ranks import Ranks

        if spec.backend == "nccl":
            import torch

            torch.cuda.set_device(0)  # Ray shows each rank its own GPU as device 0
        self.ranks = Ranks(spec.rank, spec.world, address, spec.backend, spec.timeout_s)
        with self._group():
            self.actor = LearnerActor(model_path, *args, ranks=self.ranks,
                                      rollout_log=rollout_log if self.ranks.first else "", **kwargs)

    @contextlib.contextmanager
    def _group(self):
        """A failed collective ends this rank (so its caller sees it die); any other error leaves
        the process group first, so the peers fail now instead of waiting for the timeout."""
        from threepo.services.learner.ranks import GroupBroken

        try:
            yield
        except GroupBroken:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        except BaseException:
            self.ranks.abort()
            raise

    @ray.method(num_returns=2)
    def step(self, groups: list, n_batches: int, *arrays):
        with self._group():
            return self.actor.step(groups, n_batches, *arrays)

    def published(self, reason: str = ""):
        with self._group():
            return self.actor.published(reason)

    def save_checkpoint(self, directory: str) -> str:
        with self._group():
            out = self.actor.save_checkpoint(directory)
            self.ranks.barrier()  # rank 0 answers once every shard is on disk
            return out

    def save_hf(self, directory: str) -> str:
        with self._group(), self.actor.learner.optimizer.whole():  # ZeRO-3: gathered on every rank
            out = self.actor.save_hf(directory) if self.ranks.first else directory
            self.ranks.barrier()
            return out

    def state_bytes(self) -> int:
        return self.actor.learner.optimizer.state_bytes()

    def peak_memory(self) -> int:
        return self.actor.peak_memory()


class _Fanout:
    """`.remote(...)` of one method on every rank, in rank order; returns rank 0's reference."""

    def __init__(self, ranks: list, method: str) -> None:
        self.ranks, self.method = ranks, method

    def remote(self, *args, **kwargs):
        refs = [getattr(r, self.method).remote(*args, **kwargs) for r in self.ranks]
        return refs[0]


class LearnerGroup:
    """R learner ranks behind the methods the driver calls on one learner actor."""

    def __init__(self, ranks: list, placement) -> None:
        self.ranks, self.placement = ranks, placement
        self.step = _Fanout(ranks, "step")
        self.published = _Fanout(ranks, "published")
        self.save_checkpoint = _Fanout(ranks, "save_checkpoint")
        self.save_hf = _Fanout(ranks, "save_hf")

    def state_bytes(self) -> list:
        """References to each rank's optimizer-state bytes (tests, benchmarks)."""
        return [r.state_bytes.remote() for r in self.ranks]

    def kill(self) -> None:
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        ray.util.remove_placement_group(self.placement)


def start_learner_group(cfg, name: str, runtime_env: dict, args: tuple, kwargs: dict) -> LearnerGroup:
    """`cfg.learner.ranks` rank actors named `<name>-rank<r>`, each in its bundle of one placement
    group (`runtime.learner_cpus` CPUs, and one GPU on learner.device=cuda), packed onto as few
    nodes as possible; `args`/`kwargs` are those of one `LearnerActor`."""
    lc, rt = cfg.learner, cfg.runtime
    gpus = 1 if lc.device == "cuda" else 0
    bundle = {"CPU": rt.learner_cpus, **({"GPU": gpus} if gpus else {})}
    placement = ray.util.placement_group([bundle] * lc.ranks, strategy="PACK", name=f"{name}-group")
    at = [PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=r) for r in range(lc.ranks)]
    address = ray.remote(free_address).options(num_cpus=0, scheduling_strategy=at[0]).remote()
    ranks = [
        ray.remote(LearnerRankActor).options(num_cpus=rt.learner_cpus, num_gpus=gpus, runtime_env=runtime_env,
                                             name=f"{name}-rank{r}", scheduling_strategy=at[r])
        .remote(RankSpec(r, lc.ranks, lc.resolved_backend, lc.timeout_s), address, *args, **kwargs)
        for r in range(lc.ranks)
    ]
    return LearnerGroup(ranks, placement)
