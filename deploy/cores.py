"""Where a local run's processes run (`runtime.pin_learner`): the learner on cores of its own.

On a small CPU machine the learner's update is the pipeline's critical path (the default run is
learner-bound), and every other process of the run competes with it for cores: the sampler engine,
the learner's drift process, the verifiers, the posterior server, Ray's own processes and the
driver. Whenever those are runnable and the other cores are busy, the kernel runs them on the
learner's core too and the update waits. `CorePlacement.place` gives the learner's process (all of
its threads) the last `runtime.learner_cpus` cores this driver may use and moves every other
process of the run (the driver and all its descendants: a local Ray cluster and everything it
started, the learner's own helper processes included) to the others; `release` gives them all back
the driver's cores. It applies to a local cluster (`runtime.ray_address` empty) on Linux, with one
learner process on CPU and a core to spare; elsewhere on a local cluster it does nothing and says why
(a joined cluster's placement is the cluster's: Kubernetes' CPU limits, Ray's resources).

`half_precision_note` says when a role on this machine's CPU is asked to compute in bf16 or fp16
that the CPU has no instructions for: torch then emulates those matmuls, several times slower than
fp32, and nothing else would say so.

`drift_process` decides, the same way, whether the learner's drift process (`learner.drift_process`)
has a core to run on: without one it takes CPU from the sampler engine, which then paces the run.
`CorePlacement` takes that decision once, on the driver's cores before anything is placed, for
every start of the learner (a restore included).
"""

from __future__ import annotations

import math
import os

from threepo.deploy.config import RunConfig
from threepo.services.learner.config import has_drift_process


def split(cores: set[int], learner_cpus: float) -> tuple[set[int], set[int]] | None:
    """(the learner's cores, everyone else's) out of `cores`: the last max(1, ⌊learner_cpus⌋) for
    the learner; None when that would leave no core for the rest."""
    ordered, k = sorted(cores), max(1, int(learner_cpus))
    if len(ordered) <= k:
        return None
    return set(ordered[-k:]), set(ordered[:-k])


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and brackets
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def set_cores(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores` (a process that has exited is skipped)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


class CorePlacement:
    """`runtime.pin_learner` for one run of the driver (module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        rt, learner = cfg.runtime, cfg.learner
        self.original = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.cores = None
        if not rt.pin_learner or rt.ray_address:  # off, or a cluster's own placement: nothing to say
            self.why_not = ""
        elif not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
            self.why_not = "this system has no sched_setaffinity"
        elif learner.grouped or learner.device != "cpu":
            self.why_not = "the learner is not one CPU process"
        elif (cores := split(self.original, rt.learner_cpus)) is None:
            self.why_not = f"{len(self.original)} core(s), none to spare beside the learner's"
        else:
            self.cores, self.why_not = cores, ""
        self.drift_process, self.drift_why = drift_process(cfg, self.original)  # before anything is placed
        self.precision_why = half_precision_note(cfg)

    def lines(self) -> list[str]:
        """What the driver prints about where the run's processes and the drift forward run, and
        about half precision this CPU would emulate."""
        return [line for line in (str(self), self.drift_why, self.precision_why) if line]

    def __str__(self) -> str:
        """What `place` does, or why it does nothing ('' where it was not asked to: off, or on a cluster)."""
        if self.cores is None:
            return self.why_not and f"the learner shares the machine's cores with the rest of the run: {self.why_not}"
        mine, rest = self.cores
        return (f"the learner runs on core(s) {_cores(mine)} alone, every other process of the run on "
                f"{_cores(rest)} (runtime.pin_learner)")

    def place(self, learner_pid: int) -> None:
        """Pin the learner's process and move the rest of the run (call again after the learner is
        replaced); nothing where it does not apply."""
        if self.cores is None:
            return
        mine, rest = self.cores
        for pid in [os.getpid(), *descendants(os.getpid())]:
            set_cores(pid, rest)
        set_cores(learner_pid, mine)

    def release(self) -> None:
        """The driver and all its descendants back on the driver's original cores."""
        if self.cores is not None:
            for pid in [os.getpid(), *descendants(os.getpid())]:
                set_cores(pid, self.original)


def drift_process(cfg: RunConfig, cores: set[int] | None = None) -> tuple[bool, str]:
    """(whether the learner's drift forward runs in a process of its own, why not where
    `learner.drift_process` asks for it). On a local cluster with a fixed sampler pool the process
    needs a core beyond ⌈learner_cpus⌉ + num_samplers × sampler_cpus among `cores`, the driver's
    cores before any placement (`CorePlacement.original`; default: its cores now). With none it
    shares the sampler's core, and the engine, slowed, paces the run (2 cores, one sampler: a
    default C3PO run took 50.1 s against 43.2 s with the forward in the learner). A joined cluster
    or an elastic pool, whose cores the driver cannot count, keeps the setting, as does a learner
    that has no drift process (AdamW, R ranks, a GPU)."""
    rt, learner = cfg.runtime, cfg.learner
    used = has_drift_process(cfg.optim.name, learner.ranks, learner.deepspeed_stage, learner.device, cfg.lora.rank)
    if not (learner.drift_process and used) or rt.ray_address or rt.elastic:
        return learner.drift_process, ""
    if not cores:  # not given, or unknown (no sched_getaffinity)
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    taken = math.ceil(rt.learner_cpus) + rt.num_samplers * rt.sampler_cpus
    if len(cores) - taken >= 1:
        return True, ""
    return False, (f"the drift forward runs in the learner: {len(cores)} core(s) leave none beside the learner's "
                   f"and the samplers' ({taken:g}) for its process (learner.drift_process)")


def half_precision_note(cfg: RunConfig, native: bool | None = None) -> str:
    """A line where a local run computes in half precision on this CPU (`learner.bf16` on a CPU
    learner; the hf sampler serving bfloat16 or float16 on CPU) and the CPU lacks the instructions
    for it (`native`, default: torch's AVX-512 BF16 or AMX probe); '' otherwise, and on a joined
    cluster, whose nodes are not this CPU. On an AVX2 machine a bf16 matmul took 7.3x fp32's time."""
    if cfg.runtime.ray_address:
        return ""
    asked = ["learner.bf16=true"] if cfg.learner.bf16 and cfg.learner.device == "cpu" else []
    served = cfg.model.dtype if cfg.sampler.dtype == "auto" else cfg.sampler.dtype
    if cfg.sampler.backend == "hf" and not cfg.runtime.sampler_gpus and served in ("bfloat16", "float16"):
        asked.append(f"the hf sampler serving {served}")
    if not asked:
        return ""
    if native is None:
        import torch

        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "" if native else (f"{' and '.join(asked)} on a CPU without bf16 instructions (AVX-512 BF16 or AMX): "
                              "torch emulates those matmuls, several times slower than fp32 here; fp32 is faster")


def _cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))
