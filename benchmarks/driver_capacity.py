"""Driver capacity: completions routed per second by the real driver loop with 64 sampler actors
whose engines are instant, and the driver process's CPU time per completion (issue 10 target: at
least 20,000 completions/s with the driver under one core).

Everything but the driver and the posterior server is a fake with the real actors' signatures, so
the driver (deploy/run.py `run`, with its Ledger, RunLog and Prometheus metrics) is the only real
work left:
- `FakeSampler.generate(requests, weights)` returns (GenerateReport, CompletionBatch) built with
  services/wire/batching.py `completion_batch` / `report_of` from canned samples (`--tokens` tokens
  each), loading a version's (mean, σ, checksum) by reference as SamplerActor does;
- `FakeVerifier.score(batch)` returns a ScoreBatch at once (every row `ok`, rewards alternating);
- `FakeLearner` has the LearnerActor methods the driver calls: `step(groups, n_batches, *arrays)`
  returns a StepResult with the metric keys the driver reads (step_time_s 0, reward_mean,
  staleness_max, completion_tokens) and, every `--publish-every` steps, the PublishedVersion of a
  tiny mean and σ (as `published(reason)` does), `save_checkpoint(dir)`, `save_hf(dir)`. At each step it
  also stamps the monotonic clock and the driver process's CPU time (/proc/<pid>/stat), so the
  figures cover the loop only (not start-up, the final checkpoint or the report);
- the posterior server is the real PosteriorActor (it plans the versions the driver admits under).
Fake actors take num_cpus=0, so 64 of them fit on a 2-core machine; they share its cores with the
driver, which makes the figure a lower bound of the driver's capacity (on 2 cores, 64 Ray actor
processes take about a core between them, 0.4 of it idle).

Figures over steps `--warmup`+1 .. T-1: completions/s = consumed rollouts / wall time, requests/s
and sampler calls/s (the driver's work is per call and per request more than per completion),
driver CPU seconds per completion and per wall second (cores), completions per driver CPU second
(what a driver with a core of its own would route, the rest of the run keeping up) and the
machine's busy share (/proc/stat: a full machine bounds completions/s). `--profile` samples the driver
process with py-spy during the run (non-blocking: the figures stay nearly undisturbed; without
py-spy, cProfile, which slows the driver) and prints where its CPU goes (`Profiler`).

    python3 benchmarks/driver_capacity.py [--samplers 64] [--steps 20] [--profile] [section.field=value ...]
    python3 benchmarks/driver_capacity.py --quick
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import _common
import ray

LAYOUT = ("algo.exploration=c3po", "algo.n_slots=4", "algo.group_size=16", "runtime.sampler_cpus=0",
          "runtime.verifier_cpus=0", "runtime.learner_cpus=0", "runtime.log_rollouts=false")


def driver_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every state but idle and iowait), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class FakeSampler:
    """SamplerActor's `generate(requests, weights)` over an engine that answers at once."""

    def __init__(self, engine_id: int, tokens: int) -> None:
        import uuid

        import threepo.services.wire.batching  # noqa: F401  (imported here, not in the first timed call)
        from threepo.services.wire.messages import GeneratedSample

        self.engine_id, self.incarnation = engine_id, uuid.uuid4().hex[:8]
        self.version, self.checksum, self.seq_no, self.calls = None, "", 0, 0
        self.sample = GeneratedSample(tuple(range(3, 3 + tokens)), (-1.0,) * tokens, "stop", "x" * tokens)
        self.prompt = tuple(range(3, 13))

    @ray.method(num_returns=2)
    def generate(self, requests: list, weights: list) -> tuple:
        import ray

        from threepo.services.wire.batching import completion_batch, report_of

        version = requests[0].policy_version
        if self.version != version:
            _, _, self.checksum = ray.get(weights[0])
            self.version = version
        batch = completion_batch(engine_id=self.engine_id, incarnation=self.incarnation, policy_version=version,
                                 mean_checksum=self.checksum, requests=requests, prompts=[self.prompt] * len(requests),
                                 samples=[[self.sample] * r.n for r in requests], verified=[True] * len(requests),
                                 first_seq_no=self.seq_no, generate_s=0.0)
        self.seq_no += len(batch.texts)
        self.calls += 1
        return report_of(batch), batch

    def stats(self) -> dict:
        return {"engine_id": self.engine_id, "rows": self.seq_no, "calls": self.calls}


class FakeVerifier:
    def __init__(self) -> None:
        import threepo.services.wire.messages  # noqa: F401

    def score(self, batch):
        import numpy as np

        from threepo.services.wire.messages import ScoreBatch

        rows = len(batch.texts)
        return ScoreBatch(statuses=np.zeros(rows, dtype=np.uint8),
                          rewards=(np.arange(rows) % 2).astype(np.float32), verify_s=0.0)


class FakeLearner:
    """The LearnerActor methods the driver calls, instant; stamps the driver's clock and CPU per step."""

    def __init__(self, driver_pid: int, publish_every: int) -> None:
        import numpy as np
        import torch

        from threepo.algorithms.weight_checks import weights_checksum

        self.driver_pid, self.publish_every, self.steps = driver_pid, publish_every, 0
        self.mean = {"w": np.zeros(8, dtype=np.float32)}
        self.sigma = {"w": np.full(8, 1e-3, dtype=np.float32)}
        self.checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in self.mean.items())

    @ray.method(num_returns=2)
    def step(self, groups: list, n_batches: int, *arrays):
        from threepo.services.learner.core import StepResult

        self.steps += 1
        rows = sum(n for g in groups for _, _, n in g.parts)
        publish = bool(self.publish_every) and self.steps % self.publish_every == 0
        metrics = {"step_time_s": 0.0, "reward_mean": 0.5, "staleness_max": 0.0, "staleness_mean": 0.0,
                   "completion_tokens": float(sum(len(b.token_ids) for b in arrays[:n_batches])), "rows": float(rows),
                   "clock_s": time.monotonic(), "driver_cpu_s": driver_cpu_s(self.driver_pid),
                   "machine_busy_s": machine_busy_s()}
        result = StepResult(step=self.steps, metrics=metrics, publish=publish, publish_reason="budget" if publish else None)
        return result, self.published("budget") if publish else None

    def published(self, reason: str = ""):
        from threepo.services.wire.messages import PublishedVersion

        return PublishedVersion(learner_step=self.steps, reason=reason, mean=self.mean, sigma=self.sigma,
                                mean_checksum=self.checksum)

    def save_checkpoint(self, directory: str) -> str:
        with open(os.path.join(directory, "learner.json"), "w") as f:
            f.write(f'{{"steps": {self.steps}}}')
        return "learner"

    def save_hf(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        return directory


def start_fakes(cfg, tokens: int, publish_every: int):
    import ray

    from threepo.deploy.actors import ACTOR_ENV, PosteriorActor, Roles, posterior_config

    env = {"env_vars": ACTOR_ENV}
    fake = lambda cls: ray.remote(cls).options(num_cpus=0, runtime_env=env)
    roles = Roles(posterior=fake(PosteriorActor).remote(posterior_config(cfg)),
                  samplers=[fake(FakeSampler).remote(i, tokens) for i in range(cfg.runtime.num_samplers)],
                  verifiers=[fake(FakeVerifier).remote() for _ in range(cfg.runtime.num_verifiers)],
                  learner=fake(FakeLearner).remote(os.getpid(), publish_every))
    ray.get([a.__ray_ready__.remote() for a in [roles.posterior, roles.learner, *roles.samplers, *roles.verifiers]])
    return roles


def one_run(cfg, args, profile: bool = False) -> dict:
    """The real driver loop over fresh fake roles; the figures of its metrics rows (and with
    `profile` where the driver's CPU went, see `Profiler`)."""
    import json

    import ray

    from threepo.deploy.actors import stop_roles
    from threepo.deploy.commands import make_run_dir
    from threepo.deploy.run import run

    roles = start_fakes(cfg, args.tokens, args.publish_every)
    with tempfile.TemporaryDirectory(prefix="threepo-driver-") as runs:
        run_dir = make_run_dir(dataclasses.replace(cfg, runs_dir=runs), "train")
        profiler = Profiler() if profile else None
        try:
            if profiler:
                profiler.start()
            summary = run(cfg, run_dir, roles)
            if profiler:
                profiler.stop()
            stats = ray.get([s.stats.remote() for s in roles.samplers])
        finally:
            stop_roles(roles)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if "clock_s" in line]
    out = figures(rows, args.warmup)
    out["calls"] = sum(s["calls"] for s in stats)
    out["rows_per_call"] = sum(s["rows"] for s in stats) / max(out["calls"], 1)
    out["summary"] = {k: v for k, v in summary.items() if k != "report"}
    if profiler:
        out["profile"] = profiler.report()
    return out


class Profiler:
    """Where the driver process's CPU goes during `run()`: py-spy sampling this process (every
    Python thread, on-CPU samples only, with line numbers) when py-spy is installed (it comes with
    ray[default]), else cProfile of the main thread (function level). The report ranks the
    innermost threepo frame (deploy/, services/, algorithms/) of each sample and the leaf frames."""

    def __init__(self, rate: int = 250) -> None:
        import shutil

        self.spy, self.rate = shutil.which("py-spy"), rate
        self.out = os.path.join(tempfile.mkdtemp(prefix="threepo-spy-"), "raw.txt")

    def start(self) -> None:
        import subprocess

        if self.spy:
            self.proc = subprocess.Popen([self.spy, "record", "--pid", str(os.getpid()), "--rate", str(self.rate),
                                          "--format", "raw", "--output", self.out, "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
        else:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()

    def stop(self) -> None:
        import signal

        if self.spy:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            self.proc.wait(timeout=60)
        else:
            self.prof.disable()

    def report(self, top: int = 25) -> str:
        if not self.spy:
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(self.prof, stream=text).strip_dirs().sort_stats("tottime").print_stats(top)
            return text.getvalue()
        from collections import Counter

        phases, ours, leaves = Counter(), Counter(), Counter()
        with open(self.out) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                frames, n = stack.split(";"), int(count)
                phase = next((name for key, name in PHASES if any(fr.startswith(key + " ") for fr in frames)), "loop")
                phases[phase] += n
                if phase != "loop":
                    continue
                leaves[_short(frames[-1])] += n
                mine = [fr for fr in frames if any(f"{d}/" in fr for d in ("deploy", "services", "algorithms"))]
                ours[_short(mine[-1]) if mine else "(no threepo frame: Ray's own Python threads)"] += n
        total, loop = sum(phases.values()), max(phases["loop"], 1)
        lines = [f"driver on-CPU Python samples in run(): {total} at {self.rate} Hz = {total / self.rate:.2f} CPU s "
                 f"(Ray's C++ threads are not sampled); by phase: "
                 + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in phases.most_common()),
                 "loop samples by innermost threepo frame:"]
        lines += [f"  {100 * n / loop:5.1f}%  {frame}" for frame, n in ours.most_common(top)]
        lines += ["loop samples by leaf frame:"] + [f"  {100 * n / loop:5.1f}%  {frame}" for frame, n in leaves.most_common(top)]
        return "\n".join(lines)


# (function, phase) for the samples outside the loop proper
PHASES = (("train_items", "start: prompts"), ("finish_checkpoint", "end: final checkpoint"),
          ("write_summary", "end: summary and report"))


def _short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py:12)` with the package folder kept."""
    name, _, where = frame.partition(" (")
    parts = where.rstrip(")").split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


def figures(rows: list[dict], warmup: int) -> dict:
    """Rates between the end of step `warmup` and the end of step T-1 (the last one drains)."""
    if len(rows) < warmup + 2:
        raise ValueError(f"need at least {warmup + 2} steps for the figures, got {len(rows)}")
    a, b = rows[warmup - 1], rows[-2]
    wall = b["clock_s"] - a["clock_s"]
    completions = b["consumed_rollouts"] - a["consumed_rollouts"]
    cpu = b["driver_cpu_s"] - a["driver_cpu_s"]
    return {"timed_steps": len(rows) - 1 - warmup, "wall_s": wall, "completions": completions,
            "completions_per_s": completions / wall, "driver_cpu_s": cpu, "driver_cores": cpu / wall,
            "driver_cpu_us_per_completion": 1e6 * cpu / completions,
            "per_driver_core_s": completions / cpu,
            "machine_busy": (b["machine_busy_s"] - a["machine_busy_s"]) / (wall * os.cpu_count())}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--samplers", type=int, default=64, help="fake sampler actors")
    p.add_argument("--steps", type=int, default=20, help="learner steps")
    p.add_argument("--prompts-per-step", type=int, default=256,
                   help="prompts per step (256 x 4 slots / 64 samplers = 16 requests, one full call, per sampler and step)")
    p.add_argument("--tokens", type=int, default=16, help="tokens of each canned completion")
    p.add_argument("--publish-every", type=int, default=1, help="learner steps between published versions (0: never)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start")
    p.add_argument("--profile", action="store_true", help="sample the driver with py-spy; print its hot spots")
    args = p.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.samplers = 10, 64, min(args.samplers, 16)
    import ray

    from threepo.deploy.cluster import init_ray

    cfg = _common.config(os.path.join(tempfile.gettempdir(), "no-model"), [
        *LAYOUT, f"runtime.num_samplers={args.samplers}", f"runtime.prompts_per_step={args.prompts_per_step}",
        f"runtime.steps={args.steps}", *args.overrides])
    init_ray(cfg)
    result = one_run(cfg, args, profile=args.profile)
    rt, algo = cfg.runtime, cfg.algo
    per_step = rt.prompts_per_step * algo.group_size
    requests_per_step = rt.prompts_per_step * algo.n_slots
    rows = [["completions/s", result["completions_per_s"]],
            ["requests/s", result["completions_per_s"] * requests_per_step / per_step],
            ["driver cores (CPU s / wall s)", result["driver_cores"]],
            ["driver CPU µs / completion", result["driver_cpu_us_per_completion"]],
            ["completions per driver CPU s (a driver with a core of its own)", result["per_driver_core_s"]],
            ["machine busy (all cores)", result["machine_busy"]],
            ["completions per sampler call (whole run)", result["rows_per_call"]],
            ["timed steps / completions", f"{result['timed_steps']} / {result['completions']:,}"],
            ["wall s", result["wall_s"]]]
    _common.table(f"Driver capacity: {rt.num_samplers} instant samplers, {rt.num_verifiers} verifier(s), "
                  f"{algo.exploration} N={algo.n_slots} G={algo.group_size}, {rt.prompts_per_step} prompts/step "
                  f"({per_step:,} completions, {requests_per_step:,} requests), {args.tokens} tokens each, "
                  f"requests_per_call {rt.requests_per_call}, max_offpolicy {rt.max_offpolicy}",
                  ["figure", "value"], rows)
    print(f"completions/s {result['completions_per_s']:,.0f} (target >= 20,000) with the driver at "
          f"{result['driver_cores']:.2f} cores (target < 1); {result['per_driver_core_s']:,.0f} per driver CPU "
          f"second, the machine {100 * result['machine_busy']:.0f}% busy")
    out = {"figures": result, "config": {"samplers": rt.num_samplers, "prompts_per_step": rt.prompts_per_step,
                                         "group_size": algo.group_size, "n_slots": algo.n_slots,
                                         "requests_per_call": rt.requests_per_call},
           "args": vars(args)}
    if args.profile:
        print(result["profile"])
    _common.write_results("driver_capacity", out)
    ray.shutdown()


if __name__ == "__main__":
    main()
