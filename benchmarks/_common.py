"""Helpers shared by the benchmark scripts: arguments, the model to serve, short training runs on
Ray, figures from metrics.jsonl, tables and the results file (benchmarks/results/<name>.json).

Every script takes `--model PATH` (default: the bootstrapped embedded default, built and cached on
first use; `--model tiny` builds a random tiny checkpoint for smoke runs), `--quick` and trailing
`section.field=value` overrides applied to every run it starts. Scripts report figures; they never
assert timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a fresh local Ray cluster per script: without this, ray.init() joins whatever cluster another process on
# this machine started last (/tmp/ray/ray_current_cluster) and fails on num_cpus (or runs there)
os.environ.setdefault("RAY_ADDRESS", "local")

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# quiet runs: no periodic checkpoints, no held-out evaluation inside the timed loop
RUN_DEFAULTS = ("runtime.checkpoint_every=end", "runtime.eval_every=off")


def parser(doc: str) -> argparse.ArgumentParser:
    """The common arguments; each script adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--model", default="", help="checkpoint to serve ('' = the embedded default, "
                                                "bootstrapped and cached on first use; 'tiny' = random tiny model)")
    p.add_argument("--quick", action="store_true", help="a smoke run (under a minute): fewer, shorter runs")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides for every run")
    return p


def model_path(args: argparse.Namespace) -> str:
    """`--model`, a fresh random tiny checkpoint for 'tiny', or the cached embedded default."""
    if args.model == "tiny":
        return save_tiny(tempfile.mkdtemp(prefix="threepo-bench-tiny-"))
    if args.model:
        return args.model
    from threepo.deploy.commands import policy_path
    from threepo.deploy.config import load_config

    return policy_path(load_config(None, args.overrides))


def encoded_requests(tokenizer, prompts: list, n: int = 1, seed: int = 0, prompt=None) -> list:
    """Engine requests for plain-text prompts, encoded as every role encodes them (services/tasks/prompting.py;
    `prompt`: a PromptConfig, default the run config's default)."""
    from threepo.services.evaluation import requests_for
    from threepo.services.tasks.prompting import PromptConfig, PromptEncoder

    encoder = PromptEncoder(tokenizer, prompt or PromptConfig())
    return requests_for([encoder.encode(p) for p in prompts], n, seed=seed)


def save_tiny(directory: str) -> str:
    """A randomly initialised tiny Qwen2 with the char tokenizer (as tests/conftest.py builds it)."""
    from threepo.services.model.modeling import ModelConfig, build_model
    from threepo.services.model.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = ModelConfig(kind="dense", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=128)
    model = build_model(cfg, vocab_size=72, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def config(model: str, overrides=(), runs_dir: str = "", recipe: str | None = None):
    """The run config: defaults <- `recipe` (a TOML file or a name in deploy/configs) <- quiet-run
    settings <- `overrides`, serving `model`."""
    from threepo.deploy.config import load_config

    extra = [f"runs_dir={runs_dir}"] if runs_dir else []
    return load_config(recipe, [f"model.path={model}", *RUN_DEFAULTS, *extra, *overrides])


def train_run(model: str, overrides, label: str, recipe: str | None = None, heldout: bool = False,
              runs_dir: str = "") -> dict:
    """One training run of the real driver on local Ray (`deploy.run.run` on the roles `threepo
    train` starts, without its restore loop) in a temporary directory (or under `runs_dir`, kept).
    Returns its summary, metrics rows, each sampler's stats at the end (`sampler_stats`), the time
    for every role to be constructed (`startup_s`: processes, imports, models loaded), the wall time
    of `run()` after that (`run_wall_s`), from 3 steps on the loop figures (`loop_figures`), the CPU
    each role's processes used during `run()` (`cpu`: `CpuMeter`), and with `heldout=True` the
    held-out report of its final checkpoint, evaluated as `threepo eval` does."""
    import time

    import ray

    from threepo.deploy.actors import start_roles, stop_roles
    from threepo.deploy.cluster import init_ray
    from threepo.deploy.commands import evaluate_policy, make_run_dir
    from threepo.deploy.cores import CorePlacement
    from threepo.deploy.run import run

    keep = contextlib.nullcontext(runs_dir) if runs_dir else tempfile.TemporaryDirectory(prefix="threepo-bench-")
    with keep as runs:
        cfg = config(model, overrides, runs, recipe)
        run_dir = make_run_dir(cfg, "train")
        print(f"[{label}] {cfg.runtime.mode} {cfg.algo.exploration} N={cfg.algo.n_slots} "
              f"G={cfg.algo.group_size} optim={cfg.optim.name}, {cfg.runtime.steps} steps", file=sys.stderr)
        init_ray(cfg)
        started = time.monotonic()
        cores = CorePlacement(cfg)
        roles = start_roles(cfg, model, run_dir, cores=cores)
        try:
            actors = [roles.posterior, roles.learner, *roles.samplers, *roles.verifiers]
            ray.get([a.__ray_ready__.remote() for a in actors])  # every role constructed: its model loaded
            startup = time.monotonic() - started
            if cores.cores:  # as `threepo train` does (runtime.pin_learner)
                cores.place(ray.get(roles.learner.process_id.remote()))
            for line in cores.lines():
                print(f"[{label}] {line}", file=sys.stderr)
            meter = CpuMeter(roles, os.path.join(run_dir, "metrics.jsonl"), cfg.runtime.steps)
            started = time.monotonic()
            summary = run(cfg, run_dir, roles)
            wall = time.monotonic() - started
            cpu = meter.stop(wall, summary["steps"])
            stats = ray.get([s.stats.remote() for s in roles.samplers])
        finally:
            cores.release()
            stop_roles(roles)
        report = evaluate_policy(cfg, summary["final_checkpoint"], label=f"{label} held-out") if heldout else None
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    out = {"label": label, "summary": {k: v for k, v in summary.items() if k != "report"}, "startup_s": startup,
           "run_wall_s": wall,
           "rows": rows, "sampler_stats": stats, "cpu": cpu, **(loop_figures(rows) if len(rows) >= 3 else {})}
    if report is not None:
        out["heldout"] = report.__dict__
    return out


class CpuMeter:
    """CPU seconds (user + system, all threads) each role's processes (and their child processes),
    the driver's process and the whole machine use from construction to `stop`, and given the run's
    `metrics` file and `steps`, also over the loop figures' window (`loop_figures`: from the end of
    step 1 to the end of step T-1, sampled by a thread as those rows are written), which leaves out
    what runs once at the start (the noise control's calibration, the first version). For runs on one
    machine: actors' processes are found by pid (psutil), so roles on other nodes, or started during
    the run, are not counted (a process that exits counts what it had used when last read)."""

    def __init__(self, roles, metrics: str = "", steps: int = 0) -> None:
        import psutil
        import ray

        learners = getattr(roles.learner, "ranks", [roles.learner])  # R ranks: a LearnerGroup
        handles = {"learner": learners, "samplers": roles.samplers, "verifiers": roles.verifiers,
                   "posterior": [roles.posterior]}
        pids = {role: ray.get([h.__ray_call__.remote(lambda _: os.getpid()) for h in hs])
                for role, hs in handles.items()}
        self.procs = {role: [psutil.Process(p) for p in ps] for role, ps in pids.items()}
        # a role's own helper processes count as its (the learner's drift process: services/learner/drift_process.py)
        self.procs = {role: [q for p in procs for q in (p, *p.children(recursive=True))]
                      for role, procs in self.procs.items()}
        self.procs["driver"] = [psutil.Process()]
        self.last: dict = {}
        self.start = self._sample()
        self.window: list[dict] = []  # the samples at the end of step 1 and of step T-1
        if metrics and steps >= 3:
            threading.Thread(target=self._watch, args=(metrics, (1, steps - 1)), daemon=True).start()

    def _watch(self, metrics: str, rows: tuple[int, int]) -> None:
        """Sample when the metrics file holds `rows[0]` step rows, then `rows[1]` (polled every 0.1 s)."""
        for wanted in rows:
            while True:
                with contextlib.suppress(OSError), open(metrics) as f:
                    if sum('"step_time_s"' in line for line in f) >= wanted:
                        break
                time.sleep(0.1)
            self.window.append(self._sample())

    def _sample(self) -> dict[str, float]:
        import psutil

        for p in (p for procs in self.procs.values() for p in procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                self.last[p.pid] = sum(p.cpu_times()[:2])
        used = {role: sum(self.last.get(p.pid, 0.0) for p in procs) for role, procs in self.procs.items()}
        machine = psutil.cpu_times()
        used["machine"] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return used

    def stop(self, wall_s: float, steps: int) -> dict:
        """{'per_step_s': CPU seconds per learner step of each role, the driver, 'other' (the rest of
        the machine: Ray's own processes, anything else) and 'total'; 'machine_busy': the machine's
        busy share of all its cores over `wall_s`; 'cores'; with the window sampled,
        'timed_per_step_s': the same per step over steps 2..T-1}."""
        import psutil

        end = self._sample()
        per_step, machine = _per_step(self.start, end, steps)
        cores = psutil.cpu_count()
        out = {"per_step_s": per_step, "machine_busy": machine / (wall_s * cores), "cores": cores}
        if len(self.window) == 2:  # steps 2..T-1
            out["timed_per_step_s"] = _per_step(*self.window, steps - 2)[0]
        return out


def _per_step(start: dict, end: dict, steps: int) -> tuple[dict, float]:
    """CPU seconds per step of each role between two samples, 'other' and 'total'; the machine's CPU."""
    used = {k: end[k] - start[k] for k in end}
    machine = used.pop("machine")
    per_step = {k: v / max(steps, 1) for k, v in used.items()}
    per_step["other"] = max(machine - sum(used.values()), 0.0) / max(steps, 1)
    per_step["total"] = machine / max(steps, 1)
    return per_step, machine


def loop_figures(rows: list[dict]) -> dict:
    """Figures of the training loop over steps 2..T-1: generated tokens/s, consumed rollouts/s, wall
    time per step and mean learner step time. Step 1 is warm-up (actors load, first batches). The
    last step is left out too: in async mode, rollouts of step k+1 are generated while step k trains,
    so the window from the end of step 1 starts with part of step 2 already generated; ending it at
    step T-1, when part of step T is generated, balances that (ending at T, when the run has stopped
    admitting, would count the head start as speed)."""
    if len(rows) < 3:
        raise ValueError(f"loop figures need at least 3 steps (first and last are left out), got {len(rows)}")
    timed = rows[1:-1]
    wall = rows[-2]["time_s"] - rows[0]["time_s"]
    return {
        "timed_steps": len(timed),
        "loop_wall_s": wall,
        "tokens_per_s": sum(r["completion_tokens"] for r in timed) / wall,
        "rollouts_per_s": (rows[-2]["consumed_rollouts"] - rows[0]["consumed_rollouts"]) / wall,
        "step_wall_s": wall / len(timed),
        "learner_step_s": statistics.mean(r["step_time_s"] for r in timed),
        "tokens_per_step": statistics.mean(r["completion_tokens"] for r in timed),
        "timed_tokens": sum(r["completion_tokens"] for r in timed),
        "engine_busy": engine_busy(timed),
    }


def learner_phases(rows: list[dict]) -> dict:
    """The learner's seconds per step by phase over steps 2..T-1 (metrics.jsonl `cpu/<phase>_s` and
    `time/<phase>_s`: services/learner/phases.py), as {'cpu': {phase: s}, 'wall': {phase: s}}."""
    timed = rows[1:-1] if len(rows) >= 3 else rows
    out = {}
    for kind, prefix in (("cpu", "cpu/"), ("wall", "time/")):
        keys = sorted({k for r in timed for k in r if k.startswith(prefix) and k.endswith("_s")})
        out[kind] = {k[len(prefix):-2]: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in keys}
    return out


def publish_reasons(rows: list[dict]) -> dict:
    """How many steps published, by reason (kl, ess, staleness), the steps without a publish, and the
    rollouts' mean staleness (learner steps between the version that sampled them and their step)."""
    out: dict = {}
    for r in rows:
        key = r.get("sync_reason") or "none"
        out[key] = out.get(key, 0) + 1
    stale = [r["staleness_mean"] for r in rows if "staleness_mean" in r]
    out["staleness_mean"] = round(statistics.mean(stale), 2) if stale else float("nan")
    out["drift_by_step"] = [[r.get("kl_k3_drift"), r.get("ess_frac_drift"), r.get("sync_reason")] for r in rows]
    return out


def engine_busy(rows: list[dict]) -> dict:
    """Each engine's busy fraction over `rows` (metrics.jsonl `engine_busy/engine<i>`: its
    generating seconds ÷ the step's window), weighted by the windows (`time_window_s`); 'mean' is
    the mean over engines. Engines absent from a row were idle in that window."""
    engines = sorted({k for r in rows for k in r if k.startswith("engine_busy/engine")})
    window = sum(r.get("time_window_s", 0.0) for r in rows)
    if not engines or not window:
        return {}
    out = {k.removeprefix("engine_busy/"): sum(r.get(k, 0.0) * r["time_window_s"] for r in rows) / window
           for k in engines}
    out["mean"] = sum(out.values()) / len(engines)
    return out


def posterior_arrays(model: str, cfg) -> tuple[dict, dict | None]:
    """(mean, σ) as the learner first publishes them: the checkpoint and IVON's initial σ."""
    import numpy as np

    from threepo.services.model.modeling import load_model, trainable_named_parameters

    mean = {n: p.detach().float().numpy().copy() for n, p in trainable_named_parameters(load_model(model))}
    if cfg.algo.exploration == "none":
        return mean, None
    value = 1.0 / np.sqrt(cfg.optim.ess * (cfg.optim.hess_init + cfg.optim.weight_decay))
    return mean, {n: np.full_like(a, value) for n, a in mean.items()}


def task_prompts(count: int, seed: int = 0) -> list:
    """`count` train items of the default task (the prompts a default run samples)."""
    from threepo.deploy.config import RunConfig
    from threepo.services.tasks.synthetic import generate_items

    task = RunConfig().task
    return generate_items(task.family, "train", count, seed=task.seed + seed, difficulty=task.difficulty)


def seed_band(ax, curves: list[list[float]], label: str) -> None:
    """One arm's per-step curves (one per seed, cut to the shortest) on `ax`: their mean over seeds
    and a band of ±1 std."""
    import numpy as np

    n = min(map(len, curves))
    data = np.array([c[:n] for c in curves])
    mean, std = data.mean(0), data.std(0)
    (line,) = ax.plot(np.arange(1, n + 1), mean, label=label)
    ax.fill_between(np.arange(1, n + 1), mean - std, mean + std, color=line.get_color(), alpha=0.2)


def table(title: str, headers: list[str], rows: list[list]) -> str:
    """A plain-text table; floats get 3 significant decimals."""
    cells = [[f"{c:.3g}" if isinstance(c, float) and abs(c) < 100 else
              (f"{c:,.0f}" if isinstance(c, float) else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = [title, line, "  ".join(h.rjust(w) for h, w in zip(headers, widths)), line]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    text = "\n".join(out + [line])
    print(text)
    return text


def results_path(name: str, quick: bool, ext: str = "json") -> str:
    """benchmarks/results/<name>.<ext> (git-ignored), <name>_quick.<ext> for a `--quick` run, so a
    smoke run leaves a full run's figures in place."""
    return os.path.join(RESULTS_DIR, f"{name}_quick.{ext}" if quick else f"{name}.{ext}")


def write_results(name: str, data: dict) -> str:
    """`data` as JSON at `results_path(name, data["args"]["quick"])`."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = results_path(name, bool(data.get("args", {}).get("quick")))
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    print(f"results: {path}")
    return path
