"""Checkpoints of a training run: each role writes its own part, the driver commits.

A checkpoint (run_dir/checkpoints/step-NNNNNNNN, made atomic by services/checkpoint.py: one
temporary directory, rename, pointer file `latest` last) holds the learner's training state
(learner.safetensors/.json: model mean, IVON Hessian and momentum or AdamW state, step counters;
rollouts.json: the length of rollouts.log), written by the learner actor itself; the posterior
server's published versions with their plans and checksums (posterior.safetensors/.json), written
by the posterior actor itself; and the driver's ledger (driver.json: data cursor, consumed prompts
as ranges, what to admit again, delivery counts; the length of metrics.jsonl) and the resolved
config, written by the driver (which draws from no global RNG: its sampling seeds are hashed from
ids). Nothing large passes through the driver.

The roles' saves are queued on their actors right after the step (each actor runs its calls in
order, so they save exactly the state after that step) and the driver keeps going; the checkpoint
is committed when both have answered.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


from threepo.services import checkpoint as ckpt
from threepo.services.errors import MissingPathError
from threepo.services.metrics import CATALOGUE, Metrics


@dataclass
class Pending:
    """A checkpoint being written: the roles' saves still running and the driver's snapshot."""

    step: int
    tmp: Path
    waiting: set = field(default_factory=set)    # refs of the roles' save calls
    driver: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


def begin(roles, ledger, run_dir: str, metrics_offset: int) -> Pending:
    """Start the checkpoint of the ledger's current step: the learner and posterior actors write
    their parts into a fresh temporary directory; the driver's part is snapshot now."""
    tmp = ckpt.begin_checkpoint(os.path.join(run_dir, "checkpoints"), ledger.step)
    refs = {roles.learner.save_checkpoint.remote(str(tmp)), roles.posterior.save_checkpoint.remote(str(tmp))}
    driver = {"ledger": ledger.state(), "metrics_bytes": metrics_offset}
    return Pending(ledger.step, tmp, refs, driver)


def commit(pending: Pending, run_dir: str, keep: int, metrics: Metrics | None = None) -> str:
    """Write the driver's part and make the checkpoint visible (`latest` last)."""
    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        config_bytes = f.read()
    files = {"driver.json": json.dumps(pending.driver).encode(), "config.toml": config_bytes}
    path = ckpt.commit_checkpoint(os.path.join(run_dir, "checkpoints"), pending.step, pending.tmp, files, {},
                                  keep=keep)
    _checkpoint_seconds(metrics).observe(time.perf_counter() - pending.started)
    return str(path)


def timed_write(directory: str, step: int, files: dict, meta: dict, *, keep: int,
                metrics: Metrics | None = None) -> str:
    """`services.checkpoint.write_checkpoint`, its duration observed as `threepo_checkpoint_seconds`."""
    started = time.perf_counter()
    path = ckpt.write_checkpoint(directory, step, files, meta, keep=keep)
    _checkpoint_seconds(metrics).observe(time.perf_counter() - started)
    return str(path)


@functools.cache
def _driver_metrics() -> Metrics:
    from threepo.deploy.metrics import RayMetrics

    return RayMetrics()


def _checkpoint_seconds(metrics: Metrics | None):
    spec = next(m for m in CATALOGUE if m.name == "threepo_checkpoint_seconds")
    return (metrics or _driver_metrics()).histogram(spec.name, spec.doc, spec.labels, spec.buckets)


def load_driver(path: str) -> dict:
    """The driver's part of a checkpoint (the learner and posterior actors read their own)."""
    with open(os.path.join(path, "driver.json")) as f:
        return json.load(f)


def latest_or_none(run_dir: str) -> str | None:
    found = ckpt.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    return None if found is None else str(found)


def latest(run_dir: str) -> str:
    found = ckpt.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    if found is None:
        raise MissingPathError(f"{run_dir}: no complete checkpoint under checkpoints/ to resume from")
    return str(found)


def find_run_dir(resume: str, args) -> str:
    """`--resume DIR` or `--resume auto` (the newest train run of the configured name with a checkpoint);
    a directory that is not a resumable run is a one-line `MissingPathError`."""
    if resume != "auto":
        if not os.path.isdir(resume):
            raise MissingPathError(f"--resume {resume}: no such directory; expected a train run directory")
        if not os.path.isfile(os.path.join(resume, "config.toml")):
            raise MissingPathError(f"--resume {resume}: no config.toml; expected a train run directory")
        latest(resume)  # a run without a checkpoint cannot be resumed: say so before starting anything
        return resume
    from threepo.deploy.config import load_config

    cfg = load_config(args.config, args.overrides)
    runs = sorted(glob.glob(os.path.join(cfg.runs_dir, f"{cfg.name}-train-*")), key=os.path.getmtime)
    runs = [r for r in runs if ckpt.latest_checkpoint(os.path.join(r, "checkpoints")) is not None]
    if not runs:
        raise MissingPathError(f"--resume auto: no run of name {cfg.name!r} with a checkpoint in {cfg.runs_dir}; "
                               "expected a previous `threepo train` run (name=..., runs_dir=...)")
    return runs[-1]

