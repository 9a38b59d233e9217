"""C3PO against GRPO: wall time per training step and of the whole run at equal rollouts (issue 4:
the papers claim near-identical cost, target c3po/grpo at most 1.1x per step; issue 10: the run's
wall at equal rollouts at most 1.05x).

Three runs on the same configuration, G and prompts per step:
- c3po: N=4 slots sharing one group of G, gradient at a fresh posterior sample (the default);
- grpo + ivon: algo.exploration=none algo.n_slots=1 with the same optimizer, so only the
  exploration differs (one clean policy, no noise to regenerate per slot);
- grpo_baseline: the usual GRPO baseline, `--config grpo_baseline` (AdamW, lr 1e-4).
For each: the learner step time (step_time_s, mean) and the end-to-end wall time per step, both over
steps 2..T-1 (benchmarks/_common.py: loop_figures), and the wall time of the whole run (`run()` once
the roles are constructed) with its consumed rollouts — equal across variants (same steps, prompts
per step and G), so the wall ratio is the cost ratio at equal rollouts.

    python3 benchmarks/c3po_vs_grpo.py [--steps 8] [section.field=value ...]
"""

from __future__ import annotations

import _common

VARIANTS = {  # name -> (recipe, overrides)
    "c3po": (None, ["algo.exploration=c3po", "algo.n_slots=4", "optim.name=ivon"]),
    "grpo+ivon": (None, ["algo.exploration=none", "algo.n_slots=1", "optim.name=ivon"]),
    "grpo_baseline": ("grpo_baseline", []),
}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (each run does two more)")
    args = p.parse_args()
    if args.quick:
        args.steps = 2
    model = _common.model_path(args)
    small = ["runtime.prompts_per_step=4", "algo.group_size=8"] if args.quick else []
    common = [*small, *args.overrides, f"runtime.steps={args.steps + 2}"]
    runs, failed = {}, {}
    for name, (recipe, extra) in VARIANTS.items():
        try:
            runs[name] = _common.train_run(model, [*common, *extra], name, recipe=recipe)
        except Exception as err:  # one broken variant must not hide the others' figures
            failed[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
            print(f"\n[{name}] FAILED: {failed[name]}", flush=True)
    cfg = _common.config(model, common)
    base = runs.get("grpo+ivon") or next(iter(runs.values()), None)
    if base is None:
        raise SystemExit(f"every variant failed: {failed}")
    _common.table(f"Time per training step: G={cfg.algo.group_size}, {cfg.runtime.prompts_per_step} prompts/step, "
                  f"mode {cfg.runtime.mode}, {cfg.runtime.num_samplers} samplers",
                  ["variant", "timed steps", "learner s/step", "end-to-end s/step", f"learner x {base['label']}",
                   f"end-to-end x {base['label']}", "rollouts", "run wall s", f"run wall x {base['label']}"],
                  [[name, r["timed_steps"], r["learner_step_s"], r["step_wall_s"],
                    r["learner_step_s"] / base["learner_step_s"], r["step_wall_s"] / base["step_wall_s"],
                    r["summary"]["consumed_rollouts"], r["run_wall_s"], r["run_wall_s"] / base["run_wall_s"]]
                   for name, r in runs.items()])
    ratios = {f"c3po/{b}": {"learner": runs["c3po"]["learner_step_s"] / runs[b]["learner_step_s"],
                            "end_to_end": runs["c3po"]["step_wall_s"] / runs[b]["step_wall_s"],
                            "run_wall": runs["c3po"]["run_wall_s"] / runs[b]["run_wall_s"],
                            "equal_rollouts": runs["c3po"]["summary"]["consumed_rollouts"]
                            == runs[b]["summary"]["consumed_rollouts"]}
              for b in ("grpo+ivon", "grpo_baseline") if "c3po" in runs and b in runs}
    for name, r in ratios.items():
        print(f"{name}: learner step {r['learner']:.2f}x, end-to-end step {r['end_to_end']:.2f}x (target <= 1.1x); "
              f"run wall {r['run_wall']:.2f}x at {'equal' if r['equal_rollouts'] else 'UNEQUAL'} rollouts "
              "(target <= 1.05x)")
    _common.write_results("c3po_vs_grpo", {
        "model": model, "ratios": ratios, "failed": failed,
        "runs": {n: {k: v for k, v in r.items() if k != "rows"} for n, r in runs.items()},
        "rows": {n: r["rows"] for n, r in runs.items()}, "args": vars(args)})


if __name__ == "__main__":
    main()
