"""Driver capacity: completions routed per second by the real driver loop with 64 sampler actors
whose engines are instant, and the driver process's CPU time per completion (issue 10 target: at
least 20,000 completions/s with the driver under one core).

Everything but the driver and the posterior server is a fake with the real actors' signatures, so
the driver (deploy/run.py `run`, with its Ledger, RunLog and Prometheus metrics) is the only real
work left:
- `FakeSampler.generate(requests, weights)` returns (GenerateReport, CompletionBatch) built with
  services/batching.py `completion_batch` / `report_of` from canned samples (`--tokens` tokens
  each), loading a version's (mean, σ, checksum) by reference as SamplerActor does;
- `FakeVerifier.score(batch)` returns a ScoreBatch at once (every row `ok`, rewards alternating);
- `FakeLearner` has the LearnerActor methods the driver calls: `step(groups, n_batches, *arrays)`
  returns a StepResult with the metric keys the driver reads (step_time_s 0, reward_mean,
  staleness_max, completion_tokens) and publishes every `--publish-every` steps, `published(reason)`
  a PublishedVersion of a tiny mean and σ, `save_checkpoint(dir)`, `save_hf(dir)`. At each step it
  also stamps the monotonic clock and the driver process's CPU time (/proc/<pid>/stat), so the
  figures cover the loop only (not start-up, the final checkpoint or the report);
- the posterior server is the real PosteriorActor (it plans the versions the driver admits under).
Fake actors take num_cpus=0, so 64 of them fit on a 2-core machine; they share its cores with the
driver, which makes the figure a lower bound of the driver's capacity.

Figures over steps `--warmup`+1 .. T-1: completions/s = consumed rollouts / wall time, requests/s
and sampler calls/s (the driver's work is per call and per request more than per completion), and
driver CPU seconds per completion and per wall second (cores). `--profile` runs the loop once more
under cProfile and prints where the driver's main thread spends its time.

    python3 benchmarks/driver_capacity.py [--samplers 64] [--steps 20] [--profile] [section.field=value ...]
    python3 benchmarks/driver_capacity.py --quick
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import _common

LAYOUT = ("algo.exploration=c3po", "algo.n_slots=4", "algo.group_size=16", "runtime.sampler_cpus=0",
          "runtime.verifier_cpus=0", "runtime.learner_cpus=0", "runtime.log_rollouts=false")


def driver_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FakeSampler:
    """SamplerActor's `generate(requests, weights)` over an engine that answers at once."""

    def __init__(self, engine_id: int, tokens: int) -> None:
        import uuid

        from threepo.services.engines.base import GeneratedSample

        self.engine_id, self.incarnation = engine_id, uuid.uuid4().hex[:8]
        self.version, self.checksum, self.seq_no, self.calls = None, "", 0, 0
        self.sample = GeneratedSample(tuple(range(3, 3 + tokens)), (-1.0,) * tokens, "stop", "x" * tokens)
        self.prompt = tuple(range(3, 13))

    def generate(self, requests: list, weights: list) -> tuple:
        import ray

        from threepo.services.batching import completion_batch, report_of

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
    def score(self, batch):
        import numpy as np

        from threepo.services.messages import ScoreBatch

        rows = len(batch.texts)
        return ScoreBatch(statuses=np.zeros(rows, dtype=np.uint8),
                          rewards=(np.arange(rows) % 2).astype(np.float32), verify_s=0.0)


class FakeLearner:
    """The LearnerActor methods the driver calls, instant; stamps the driver's clock and CPU per step."""

    def __init__(self, driver_pid: int, publish_every: int) -> None:
        import numpy as np
        import torch

        from threepo.algorithms.param_noise import weights_checksum

        self.driver_pid, self.publish_every, self.steps = driver_pid, publish_every, 0
        self.mean = {"w": np.zeros(8, dtype=np.float32)}
        self.sigma = {"w": np.full(8, 1e-3, dtype=np.float32)}
        self.checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in self.mean.items())

    def step(self, groups: list, n_batches: int, *arrays):
        from threepo.services.learner import StepResult

        self.steps += 1
        rows = sum(n for g in groups for _, _, n in g.parts)
        publish = bool(self.publish_every) and self.steps % self.publish_every == 0
        metrics = {"step_time_s": 0.0, "reward_mean": 0.5, "staleness_max": 0.0, "staleness_mean": 0.0,
                   "completion_tokens": float(sum(len(b.token_ids) for b in arrays[:n_batches])), "rows": float(rows),
                   "clock_s": time.monotonic(), "driver_cpu_s": driver_cpu_s(self.driver_pid)}
        return StepResult(step=self.steps, metrics=metrics, publish=publish, publish_reason="budget" if publish else None)

    def published(self, reason: str = ""):
        from threepo.services.messages import PublishedVersion

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
    fake = lambda cls: ray.remote(cls).options(num_cpus=0, runtime_env=env)  # noqa: E731
    roles = Roles(posterior=fake(PosteriorActor).remote(posterior_config(cfg)),
                  samplers=[fake(FakeSampler).remote(i, tokens) for i in range(cfg.runtime.num_samplers)],
                  verifiers=[fake(FakeVerifier).remote() for _ in range(cfg.runtime.num_verifiers)],
                  learner=fake(FakeLearner).remote(os.getpid(), publish_every))
    ray.get([a.__ray_ready__.remote() for a in [roles.posterior, roles.learner, *roles.samplers, *roles.verifiers]])
    return roles


def one_run(cfg, args, profile: bool = False) -> dict:
    """The real driver loop over fresh fake roles; the figures of its metrics rows."""
    import cProfile
    import io
    import json
    import pstats

    from threepo.deploy.actors import stop_roles
    from threepo.deploy.cli import make_run_dir
    from threepo.deploy.run import run

    import ray

    roles = start_fakes(cfg, args.tokens, args.publish_every)
    with tempfile.TemporaryDirectory(prefix="threepo-driver-") as runs:
        run_dir = make_run_dir(dataclasses.replace(cfg, runs_dir=runs), "train")
        profiler = cProfile.Profile() if profile else None
        try:
            if profiler:
                profiler.enable()
            summary = run(cfg, run_dir, roles)
            if profiler:
                profiler.disable()
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
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
        out["profile"] = text.getvalue()
    return out


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
            "driver_cpu_us_per_completion": 1e6 * cpu / completions}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--samplers", type=int, default=64, help="fake sampler actors")
    p.add_argument("--steps", type=int, default=20, help="learner steps")
    p.add_argument("--prompts-per-step", type=int, default=256,
                   help="prompts per step (256 x 4 slots / 64 samplers = 16 requests, one full call, per sampler and step)")
    p.add_argument("--tokens", type=int, default=16, help="tokens of each canned completion")
    p.add_argument("--publish-every", type=int, default=1, help="learner steps between published versions (0: never)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start")
    p.add_argument("--profile", action="store_true", help="one more run under cProfile; print the driver's hot spots")
    args = p.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.samplers = 10, 64, min(args.samplers, 16)
    import ray

    from threepo.deploy.actors import init_ray

    cfg = _common.config(os.path.join(tempfile.gettempdir(), "no-model"), [
        *LAYOUT, f"runtime.num_samplers={args.samplers}", f"runtime.prompts_per_step={args.prompts_per_step}",
        f"runtime.steps={args.steps}", *args.overrides])
    init_ray(cfg)
    result = one_run(cfg, args)
    rt, algo = cfg.runtime, cfg.algo
    per_step = rt.prompts_per_step * algo.group_size
    requests_per_step = rt.prompts_per_step * algo.n_slots
    rows = [["completions/s", result["completions_per_s"]],
            ["requests/s", result["completions_per_s"] * requests_per_step / per_step],
            ["driver cores (CPU s / wall s)", result["driver_cores"]],
            ["driver CPU µs / completion", result["driver_cpu_us_per_completion"]],
            ["completions per sampler call (whole run)", result["rows_per_call"]],
            ["timed steps / completions", f"{result['timed_steps']} / {result['completions']:,}"],
            ["wall s", result["wall_s"]]]
    _common.table(f"Driver capacity: {rt.num_samplers} instant samplers, {rt.num_verifiers} verifier(s), "
                  f"{algo.exploration} N={algo.n_slots} G={algo.group_size}, {rt.prompts_per_step} prompts/step "
                  f"({per_step:,} completions, {requests_per_step:,} requests), {args.tokens} tokens each, "
                  f"requests_per_call {rt.requests_per_call}, max_offpolicy {rt.max_offpolicy}",
                  ["figure", "value"], rows)
    print(f"completions/s {result['completions_per_s']:,.0f} (target >= 20,000) with the driver at "
          f"{result['driver_cores']:.2f} cores (target < 1)")
    out = {"figures": result, "config": {"samplers": rt.num_samplers, "prompts_per_step": rt.prompts_per_step,
                                         "group_size": algo.group_size, "n_slots": algo.n_slots,
                                         "requests_per_call": rt.requests_per_call},
           "args": vars(args)}
    if args.profile:
        profiled = one_run(cfg, args, profile=True)
        print(profiled["profile"])
        out["profile"] = profiled["profile"]
    _common.write_results("driver_capacity", out)
    ray.shutdown()


if __name__ == "__main__":
    main()
