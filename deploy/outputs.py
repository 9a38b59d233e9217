"""What a training run writes as it goes, owned by the driver: `metrics.jsonl` (one row per learner
step, plus held-out rows), the progress bar, the driver's Prometheus metrics, and where the time of
each step went (generating, verifying, learning, the learner waiting for data, each engine's busy
fraction).

A resumed run continues the same file exactly: the checkpoint holds the byte length metrics.jsonl
had at that step, the file is cut back to it, and held-out rows of steps up to the checkpoint that
arrived after that point (evaluations run concurrently) are put back, so no step is recorded twice
and none is lost.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from threepo.services.evaluation import TRUNCATION_WARNING


@dataclass
class Window:
    """Work seen by the driver since the last learner result (the step being logged)."""

    started: float = field(default_factory=time.monotonic)
    generate_s: Counter = field(default_factory=Counter)   # engine id -> engine seconds
    tokens: Counter = field(default_factory=Counter)       # engine id -> tokens generated
    verify_s: float = 0.0
    learner_wait_s: float = 0.0

    def figures(self, learn_s: float) -> dict:
        wall = max(time.monotonic() - self.started, 1e-9)
        out = {"time_window_s": wall, "time_generate_s": sum(self.generate_s.values()),
               "time_verify_s": self.verify_s, "time_learn_s": learn_s, "time_learner_wait_s": self.learner_wait_s}
        for engine, seconds in sorted(self.generate_s.items()):
            out[f"engine_busy/engine{engine}"] = min(1.0, seconds / wall)
            out[f"tokens_per_s/engine{engine}"] = self.tokens[engine] / wall
        if self.generate_s:
            out["engine_busy_mean"] = sum(min(1.0, s / wall) for s in self.generate_s.values()) / len(self.generate_s)
        return out


def resume_metrics_file(path: str, offset: int, step: int) -> None:
    """Cut metrics.jsonl back to `offset` bytes (its length at the checkpoint of `step`), keeping
    the held-out rows of steps ≤ `step` written after that point."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        head, tail = f.read(offset), f.read()
    late = [line for line in tail.decode().splitlines()
            if line.strip() and "heldout_pass1" in json.loads(line) and json.loads(line).get("step", step + 1) <= step
            and "reward_mean" not in json.loads(line)]
    with open(path, "wb") as f:
        f.write(head + "".join(line + "\n" for line in late).encode())


class RunLog:
    """metrics.jsonl, the experiment trackers that copy its rows (deploy/trackers.py), the progress
    bar with its one-line step summary, and the driver's metrics of one run."""

    def __init__(self, run_dir: str, cfg, initial: int) -> None:
        import dataclasses

        from tqdm import tqdm

        from threepo.deploy.metrics import RayMetrics
        from threepo.deploy.trackers import make_trackers
        from threepo.services.metrics import register_catalogue

        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a")
        rt = cfg.runtime
        self.trackers = make_trackers(rt.trackers, run_dir, project=rt.wandb_project, mode=rt.wandb_mode,
                                      config=dataclasses.asdict(cfg))
        method = cfg.algo.exploration if cfg.algo.exploration != "none" else cfg.algo.advantage  # c3po; grpo
        self.bar = tqdm(total=rt.steps, initial=initial, desc=f"train {method}", unit="step")
        self.metrics = register_catalogue(RayMetrics())
        self.started = time.monotonic()
        self._truncated, self._rollouts, self._warned = 0.0, 0, False

    def step(self, row: dict) -> None:
        self._write(row)
        self._truncated += row.get("truncated_rate", 0.0) * row.get("rollouts", 0)
        self._rollouts += row.get("rollouts", 0)
        if not self._warned and self._rollouts and self._truncated / self._rollouts > TRUNCATION_WARNING:
            self._warned = True  # once a run: the share so far, over every step yet
            self.bar.write(f"threepo: warning: {self._truncated / self._rollouts:.0%} of completions so far ended at "
                           f"the length limit (over {TRUNCATION_WARNING:.0%}; they score malformed): raise "
                           "sampler.max_new_tokens")
        self.bar.set_postfix_str(step_summary(row))
        self.bar.update(1)

    def heldout(self, step: int, pass1: float, n: int) -> None:
        self._write({"step": step, "heldout_pass1": pass1, "heldout_n": n})

    def offset(self) -> int:
        return self.file.tell()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(row)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


def step_summary(row: dict) -> str:
    """The progress bar's one line for a step: reward, loss, KL of the behaviour to the learner's
    policy, gradient norm, tokens per second over the engines, the learner's peak memory, version and
    staleness (a figure the step did not report is left out)."""
    tokens = sum(v for k, v in row.items() if k.startswith("tokens_per_s/"))
    parts = [("reward", row.get("reward_mean"), ".2f", ""), ("loss", row.get("loss"), ".3g", ""),
             ("kl", row.get("kl_k3"), ".2g", ""), ("|g|", row.get("grad_norm"), ".3g", ""),
             ("tok/s", tokens or None, ".0f", ""), ("mem", row.get("learner_peak_mib"), ".0f", " MiB")]
    text = " ".join(f"{name} {value:{spec}}{unit}" for name, value, spec, unit in parts if value is not None)
    return f"{text} v{row.get('version')} stale {row.get('staleness_max', 0):.0f}"


def record_driver_metrics(handles: dict, row: dict, counts, reported: dict) -> None:
    """The step's queue depths, busy ratios and delivery counts into the Prometheus catalogue."""
    handles["threepo_queue_depth"].set(row["groups_in_flight"], role="sampler")
    handles["threepo_queue_depth"].set(row["groups_ready"], role="learner")
    for key, value in row.items():
        if key.startswith("engine_busy/engine"):
            handles["threepo_engine_busy_ratio"].set(value, engine_id=key.removeprefix("engine_busy/engine"))
    for role, seconds in (("sampler", row["time_generate_s"]), ("verifier", row["time_verify_s"]),
                          ("learner", row["time_learn_s"])):
        handles["threepo_busy_seconds_total"].inc(seconds, role=role)
    handles["threepo_learner_wait_seconds_total"].inc(row["time_learner_wait_s"])
    for reason, count in (("checksum", counts.rejected_weights), ("duplicate", counts.duplicates)):
        if count > reported.get(reason, 0):
            handles["threepo_rejected_completions_total"].inc(count - reported.get(reason, 0), reason=reason)
            reported[reason] = count


def delivery_figures(s) -> dict:
    """The ledger's delivery counts for a step's row (`s`: the driver's Loop)."""
    c = s.ledger.counts
    return {"admitted_rollouts": c.admitted_rollouts, "consumed_rollouts": c.consumed_rollouts,
            "groups_in_flight": len(s.ledger.groups) - s.ledger.ready(), "groups_ready": s.ledger.ready(),
            "reissued_requests": c.reissued_requests, "rejected_weights": c.rejected_weights,
            **s.ledger.exploration_figures()}


def write_summary(s, run_dir: str, **extra) -> dict:
    """summary.json at the end of a run (`s`: the driver's Loop): delivery counts, wall, each role's
    peak memory, the MiB one engine receives per version (m and σ; a LoRA posterior's: the
    adapters'), the report's files; `extra`: why it stopped or the final checkpoint."""
    from dataclasses import asdict

    from threepo.deploy.actors import role_memory
    from threepo.deploy.report import make_report

    import ray

    s.log.close()
    memory = role_memory(s.roles)
    version_bytes = ray.get(s.roles.posterior.bytes_of.remote(s.ledger.version))
    summary = {**extra, "steps": s.ledger.step, "version": s.ledger.version, **asdict(s.ledger.counts),
               "consumed_prompts": len(s.ledger.consumed), "version_mb": round(version_bytes / 2**20, 3),
               "wall_s": round(s.log.elapsed(), 2), "peak_memory_mb": memory,
               "peak_memory_total_mb": round(sum(memory.values()), 1),
               "report": [str(p) for p in make_report(run_dir)] if s.ledger.step else []}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
