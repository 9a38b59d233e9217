"""The run's `[runtime]` section: how the roles run on Ray and how the driver schedules them
(deploy/run.py), composed into `RunConfig` by deploy/config.py."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RuntimeConfig:
    """How the roles run on Ray and how the driver schedules them (deploy/run.py)."""

    mode: Literal["async", "sync"] = "async"
    """async: sampling, verification and learning overlap under a staleness bound; sync: one phase
    after another on the same components (for comparison)."""
    steps: int = 250
    """Learner steps to run."""
    prompts_per_step: int = 8
    """Prompts whose groups make one learner step (M3PO: each prompt gives M groups)."""
    max_offpolicy: int = 1
    """Admission bound: prompts are admitted only while every admitted group will be consumed
    within this many learner steps after the current one (admission control, never discarding)."""
    num_samplers: int | Literal["elastic"] = 1
    """Sampler engine actors (the hf engine decodes a call's slots together, vllm and sglang serve them
    one at a time; on 2 cores one engine beside the learner is fastest), or `elastic`: one sampler per
    unit of `runtime.sampler_resource` the cluster offers, started as nodes join, dropped (their work
    re-issued) as nodes leave."""
    sampler_resource: str = "threepo_sampler"
    """Elastic pool (num_samplers = "elastic"): the custom Ray resource a node offers per sampler it can
    host (`ray start --resources='{"threepo_sampler": 1}'`; the KubeRay sampler group sets it)."""
    request_samplers: int = 0
    """Elastic pool: ask the cluster's autoscaler for this many units of `sampler_resource`
    (ray.autoscaler.sdk.request_resources), so KubeRay grows the sampler group (0 = ask for none)."""
    pool_check_s: float = 2.0
    """Elastic pool: seconds between looks at the cluster's sampler capacity."""
    sampler_cpus: float = 1.0
    """Ray CPUs per sampler actor (its torch threads follow)."""
    sampler_gpus: float = 0.0
    """Ray GPUs per sampler actor (vllm/sglang on CUDA: `sampler.tensor_parallel_size`; 0 = CPU)."""
    num_verifiers: int = 1
    """Verifier-pool actors (synchronous, so math-verify's SIGALRM timeouts work)."""
    verifier_cpus: float = 0.25
    """Ray CPUs per verifier actor."""
    learner_cpus: float = 1.0
    """Ray CPUs of the learner actor (its torch threads follow)."""
    pin_learner: bool = True
    """Local clusters on Linux with one CPU learner: the learner's process runs alone on the last
    `learner_cpus` cores and every other process of the run (Ray's, the roles', the drift process,
    the driver) on the rest, so sampling never preempts the update (deploy/cores.py). The driver
    prints where each runs, or why it does not pin."""
    requests_per_call: int = 32
    """Most rollout requests sent to one sampler in one call (32: a default C3PO step's 8 prompts ×
    4 slots, decoded together in one engine call; two calls of 16 cost that engine 1.2x the CPU)."""
    checkpoint_every: int | Literal["end"] = 50
    """Learner steps between checkpoints, or `end`: only the final one."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run directory."""
    eval_every: int | Literal["off"] = 50
    """Learner steps between held-out evaluations during training, one sample per item at the
    sampling temperature, by an evaluator actor off the learner's critical path; `off`: none during
    training (the evaluations before and after it are `eval.around_training`)."""
    eval_cpus: float = 0.25
    """Ray CPUs of the evaluator actor (it works only every `eval_every` steps)."""
    eval_gpus: float | Literal["auto"] = "auto"
    """Ray GPUs of the evaluator actor: `auto` is one whole GPU with `eval.device=cuda`, none
    otherwise; a fraction shares a sampler's GPU (e.g. runtime.sampler_gpus=0.9 and 0.1 here)."""
    ray_address: str = ""
    """Ray cluster to join ('' = start a local one; 'auto' = the cluster this runs in)."""
    metrics_port: int = 8090
    """Local clusters only: the port of Ray's metrics agent, where Prometheus scrapes every role's
    `threepo_*` metrics (`http://127.0.0.1:8090/metrics` by default). When it is taken (another run
    on this machine) Ray picks a free one and the driver prints which; 0 = always a free one. A
    joined cluster keeps its own (KubeRay: 8080 on every node)."""
    metrics_host: Literal["127.0.0.1", "0.0.0.0"] = "127.0.0.1"
    """Local clusters only: 127.0.0.1 keeps the metrics port (and the rest of the local Ray cluster)
    on loopback; 0.0.0.0 serves it on every interface, for a Prometheus on another machine."""
    max_reissues: int = 5
    """A request re-issued more often than this (crashes, checksum mismatches, infra errors) stops the run."""
    sampler_restart_s: float = 900.0
    """Fixed pool: how long the driver waits for a sampler that Ray is restarting (its requests go
    to the other samplers or wait; none is spent) before it stops the run. An engine loading a
    large model takes minutes."""
    max_restores: int = 3
    """Times the driver restarts a dead learner or posterior server from the latest checkpoint by
    itself before it stops with the resume command (0 = stop at once)."""
    log_rollouts: bool = True
    """Append every consumed group (msgpack, schema-versioned; one record of the step's arrays per
    step, `batching.logged_groups` reads them as groups) to `rollouts.log` in the run directory."""
    trackers: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Experiment trackers that receive every metrics.jsonl row (training steps and held-out rows):
    `tensorboard` (event files in <run dir>/tensorboard), `wandb` (Weights & Biases, under <run
    dir>/wandb, `runtime.wandb_mode`). Needs `pip install 'threepo[tracking]'`."""
    wandb_project: str = "threepo"
    """W&B project the run is logged to (the run's name is its run directory's)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: no account or network needed; `wandb sync <run dir>/wandb/offline-run-*` uploads it
    later. online: logs as it goes (needs `wandb login` or WANDB_API_KEY)."""

    @property
    def elastic(self) -> bool:
        """Is the sampler pool elastic (`num_samplers = "elastic"`)?"""
        return self.num_samplers == "elastic"

    @property
    def fixed_samplers(self) -> int:
        """Samplers started with the run (none in an elastic pool: they come as nodes offer them)."""
        return 0 if self.elastic else self.num_samplers

    def __post_init__(self) -> None:
        for tracker in self.trackers:
            if importlib.util.find_spec(tracker) is None:
                raise ValueError(f"runtime.trackers: {tracker} is not installed (pip install 'threepo[tracking]')")
        if not self.sampler_restart_s > 0:
            raise ValueError(f"runtime.sampler_restart_s: expected > 0, got {self.sampler_restart_s}")
        if self.num_samplers != "elastic" and self.num_samplers < 1:
            raise ValueError(f"runtime.num_samplers: expected >= 1, or \"elastic\" (one sampler per unit of "
                             f"runtime.sampler_resource the cluster offers), got {self.num_samplers}")
        if self.request_samplers < 0 or not self.pool_check_s > 0:
            raise ValueError("runtime.request_samplers: expected >= 0, runtime.pool_check_s: expected > 0")
        for name, word, meaning in (("checkpoint_every", "end", "only the final checkpoint"),
                                    ("eval_every", "off", "no evaluation during training")):
            if getattr(self, name) != word and getattr(self, name) < 1:
                raise ValueError(f"runtime.{name}: expected steps >= 1, or \"{word}\" ({meaning}), "
                                 f"got {getattr(self, name)}")
        if self.eval_gpus != "auto" and self.eval_gpus < 0:
            raise ValueError(f"runtime.eval_gpus: expected >= 0 or \"auto\", got {self.eval_gpus}")
        for name in ("steps", "prompts_per_step", "num_verifiers", "requests_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"runtime.{name}: expected >= 1, got {getattr(self, name)}")
        if self.sampler_gpus < 0:
            raise ValueError(f"runtime.sampler_gpus: expected >= 0, got {self.sampler_gpus}")
        if self.max_offpolicy < 0:
            raise ValueError(f"runtime.max_offpolicy: expected >= 0, got {self.max_offpolicy}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"runtime.metrics_port: expected a port in [0, 65535], got {self.metrics_port}")
