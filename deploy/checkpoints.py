"""What a training checkpoint holds and how the driver restores from it.

A checkpoint (run_dir/checkpoints/step-NNNNNNNN, written atomically by services/checkpoint.py: tmp
directory, rename, pointer file `latest` last) holds: the learner's training state (model mean,
IVON Hessian and momentum, step count, or AdamW state) as safetensors; the posterior server's
published versions with their plan seeds; the driver's data cursor, consumed completion ids,
admitted-but-unconsumed groups (regenerated on resume), delivery counts; RNG states; and the
resolved config.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time

import numpy as np

from threepo.services import checkpoint as ckpt
from threepo.services.errors import MissingPathError
from threepo.services.metrics import CATALOGUE, Metrics


def save(s, run_dir: str, metrics: Metrics | None = None) -> str:
    """Checkpoint the learner, the posterior server and the driver state of loop `s`; the time the
    write takes goes to `threepo_checkpoint_seconds` (on `metrics`, by default the driver's Ray metrics)."""
    import ray

    tensors, learner_meta = ray.get(s.roles.learner.state.remote())
    posterior = ray.get(s.roles.posterior.state.remote())
    post_tensors, post_meta = _split_posterior(posterior)
    open_prompts: dict[int, list[int]] = {}
    for index, g in s.open_groups.values():
        open_prompts.setdefault(index, []).append(g)
    d = s.delivery
    driver = {"step": s.step, "next_index": s.next_index, "version": s.version,
              "readmit": sorted([i, sorted(gs)] for i, gs in open_prompts.items()) + [list(x) for x in s.readmit],
              "consumed_ids": sorted(d.consumed_ids),
              "delivery": {k: getattr(d, k) for k in ("admitted_rollouts", "consumed_rollouts", "reissued_requests",
                                                      "rejected_checksum", "infra_errors", "sampler_failures")},
              "published_step": {str(k): v for k, v in s.published_step.items()}}
    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        config_bytes = f.read()
    files = {
        "learner.safetensors": lambda p: ckpt.save_tensors(p, tensors),
        "learner.json": json.dumps(learner_meta).encode(),
        "posterior.safetensors": lambda p: ckpt.save_tensors(p, post_tensors),
        "posterior.json": json.dumps(post_meta).encode(),
        "driver.json": json.dumps(driver).encode(),
        "config.toml": config_bytes,
    }
    meta = {"rng": _jsonable(ckpt.capture_rng_state()), "version": s.version}
    return timed_write(os.path.join(run_dir, "checkpoints"), s.step, files, meta,
                       keep=s.cfg.runtime.keep_checkpoints, metrics=metrics)


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


def load(path: str) -> dict:
    """Read a checkpoint directory back (what `save` wrote). In-flight references are dropped:
    everything admitted but unconsumed is regenerated, so nothing old needs to stay alive."""
    with open(os.path.join(path, "posterior.json")) as f:
        post_meta = json.load(f)
    posterior = _join_posterior(ckpt.load_tensors(os.path.join(path, "posterior.safetensors")), post_meta)
    for v in posterior["versions"]:
        v["refcount"] = 0
    with open(os.path.join(path, "learner.json")) as f:
        learner_meta = json.load(f)
    with open(os.path.join(path, "driver.json")) as f:
        driver = json.load(f)
    return {"learner_tensors": ckpt.load_tensors(os.path.join(path, "learner.safetensors")),
            "learner_meta": learner_meta, "posterior": posterior, "driver": driver}


def restore_driver(s, saved: dict) -> None:
    """Put loop `s` (freshly started roles) back where the checkpoint left it."""
    import ray

    ray.get(s.roles.learner.load_state.remote(saved["learner_tensors"], saved["learner_meta"]))
    d = saved["driver"]
    s.step, s.next_index, s.version = d["step"], d["next_index"], d["version"]
    s.readmit = [(i, set(gs)) for i, gs in d["readmit"]]
    s.admitted_prompts = s.step * s.cfg.runtime.prompts_per_step
    s.delivery.consumed_ids = set(d["consumed_ids"])
    for key, value in d["delivery"].items():
        setattr(s.delivery, key, value)
    s.published_step = {int(k): v for k, v in d["published_step"].items()}
    s.plan = ray.get(s.roles.posterior.plan.remote(s.version))
    s.weights_refs[s.version] = s.roles.posterior.weights.remote(s.version)
    for v in ray.get(s.roles.posterior.versions.remote()):
        s.mean_checksums[v] = ray.get(s.roles.posterior.mean_checksum.remote(v))


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


def _split_posterior(state: dict) -> tuple[dict, dict]:
    tensors, versions = {}, []
    for v in state["versions"]:
        for part in ("mean", "sigma"):
            for name, array in (v[part] or {}).items():
                tensors[f"v{v['version']}/{part}/{name}"] = np.asarray(array)
        versions.append({k: val for k, val in v.items() if k not in ("mean", "sigma")} |
                        {"has_sigma": v["sigma"] is not None, "names": sorted(v["mean"])})
    return tensors, {"config": state["config"], "current": state["current"], "versions": versions}


def _join_posterior(tensors: dict, meta: dict) -> dict:
    versions = []
    for v in meta["versions"]:
        n = v["version"]
        mean = {name: tensors[f"v{n}/mean/{name}"] for name in v["names"]}
        sigma = {name: tensors[f"v{n}/sigma/{name}"] for name in v["names"]} if v["has_sigma"] else None
        versions.append({k: val for k, val in v.items() if k not in ("has_sigma", "names")} |
                        {"mean": mean, "sigma": sigma})
    return {"config": meta["config"], "current": meta["current"], "versions": versions}


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
