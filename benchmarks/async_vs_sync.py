"""Asynchronous against synchronous mode on the same configuration: consumed rollouts/s of the
training loop, speed-up = async / sync (issue 4: the bound is 2x, target at least 1.6x).

Both runs use one sampler actor and the learner, each with one CPU and one torch thread
(runtime.sampler_cpus=1, runtime.learner_cpus=1), so on 2 cores the modes differ only in overlap:
sync samples a step's rollouts, then trains on them, with one core idle in each phase; async
samples the next step's rollouts while the learner trains (staleness bound runtime.max_offpolicy).
When generating a step takes as long as training on it, async approaches 2x. The script also
prints (a + b) / max(a, b) from the sync run (a = time per step outside the learner, b = learner
step): the speed-up of hiding the learner alone; async can beat it slightly, since it also overlaps
scoring and driver round trips with generation.
Rollouts/s = consumed rollouts of steps 2..T-1 / wall time from the end of step 1 to the end of
step T-1 (benchmarks/_common.py: loop_figures says why the last step is left out).

    python3 benchmarks/async_vs_sync.py [--steps 16] [section.field=value ...]
"""

from __future__ import annotations

import _common

LAYOUT = ("runtime.num_samplers=1", "runtime.sampler_cpus=1", "runtime.learner_cpus=1")


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=16, help="timed steps per mode (each run does two more: warm-up and drain)")
    args = p.parse_args()
    if args.quick:
        args.steps = 3
    model = _common.model_path(args)
    small = ["runtime.prompts_per_step=4", "algo.group_size=8"] if args.quick else []
    common = [*LAYOUT, *small, *args.overrides, f"runtime.steps={args.steps + 2}"]
    runs = {mode: _common.train_run(model, [*common, f"runtime.mode={mode}"], mode) for mode in ("sync", "async")}
    rows = [[mode, r["summary"]["consumed_rollouts"], r["timed_steps"], r["loop_wall_s"], r["rollouts_per_s"],
             r["step_wall_s"], r["learner_step_s"]] for mode, r in runs.items()]
    cfg = _common.config(model, common)
    _common.table(f"Async vs sync: {cfg.algo.exploration} N={cfg.algo.n_slots} G={cfg.algo.group_size}, "
                  f"{cfg.runtime.prompts_per_step} prompts/step, {cfg.runtime.num_samplers} sampler(s)",
                  ["mode", "rollouts", "timed steps", "loop s", "rollouts/s", "s/step", "learner s/step"], rows)
    speedup = runs["async"]["rollouts_per_s"] / runs["sync"]["rollouts_per_s"]
    sync = runs["sync"]
    learn = sync["learner_step_s"]
    generate = max(sync["step_wall_s"] - learn, 1e-9)  # sync: a step is generation (+ scoring), then learning
    bound = (generate + learn) / max(generate, learn)
    print(f"speed-up async/sync = {speedup:.2f}x (target >= 1.6x, bound 2x)")
    print(f"sync step = {generate:.2f}s outside the learner (generation, scoring, round trips) + {learn:.2f}s "
          f"learning: hiding the learner alone behind generation gives {bound:.2f}x; async also overlaps "
          "scoring and round trips with generation")
    _common.write_results("async_vs_sync", {
        "model": model, "speedup": speedup, "learner_overlap_estimate": bound,
        "runs": {m: {k: v for k, v in r.items() if k != "rows"} for m, r in runs.items()},
        "rows": {m: r["rows"] for m, r in runs.items()}, "args": vars(args)})


if __name__ == "__main__":
    main()
