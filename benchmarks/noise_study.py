"""Does parameter noise help? (issue 39) SmolLM2-135M-Instruct on word problems, four arms, paired seeds.

Arms (each at equal rollouts: the same steps × prompts × group size; run s of every arm has seed s,
so the same prompt order and the same held-out problems):
- `grpo`: GRPO with AdamW (`--config grpo_baseline`), the reference;
- `grpo_ivon`: GRPO on IVON with no parameter noise (the mean served): C3PO's optimizer without its
  noise — the arm that separates the optimizer from the noise;
- `c3po`: C3PO, N = 4 slots, the default noise controls;
- `c3po_lora`: C3PO over rank-8 LoRA adapters.
The model and its settings are benchmarks/real_model.py's (chat template, answers scored by their last
number, T 0.7, bf16, `REAL_ARMS`' optimizers), on `--difficulty` word problems (services/tasks/word_problems.py),
each question followed by `--instruction` (`BRIEF`), `--limit` tokens at most; held-out problems are
evaluated in the dtype the samplers serve.

Phases (`--phase`, in this order; each writes as it goes and skips what its files already hold, so a
study can be stopped and continued over several sittings):
- `task`: the start checkpoint on each candidate task (`--candidates`: difficulty:limit), 128
  held-out problems × 16 samples at T and greedy: pass@1, truncated share, and the chance that a group
  of G samples has zero advantage (`paired.zero_advantage_chance`). The study's task wants a start
  pass@1 low but not 0, ≥ 40% zero-advantage groups and ≤ 5% truncated.
- `tune`: matched movement. The reference (`grpo` at its `REAL_ARMS` step size) and each other arm
  run once on the tuning seed (`--tune-seed`, not a study seed) for the study's steps; an arm whose
  ‖θ_T − θ_0‖ / ‖θ_0‖ is not within ±15% of the reference's has its `optim.lr` scaled by the ratio
  and runs again (`--tune-rounds`). The step size each arm's last tuning run used is its setting.
- `study`: every arm × `--seeds` seeds at the tuned step sizes, seed by seed (a study stopped early
  has every arm at the seeds it ran).
- `report`: for each arm pair, the mean paired difference over seeds and its 95% interval (t over
  seeds; for held-out figures also a bootstrap over seeds and problems, `paired.py`) of greedy
  pass@1, pass@1, pass@16, zero-advantage groups, dead groups rescued and malformed answers; the
  table (report.md) and the figure (figure.png).
Each run's record holds its settings, the commit, the per-problem counts, the training curves and
its movement.

Files: `--out` (benchmarks/results/noise_study/, committed: task.jsonl, tuning.jsonl, runs.jsonl,
report.md, figure.png; `--quick`: benchmarks/results/noise_study_quick/, git-ignored).

    python3 benchmarks/noise_study.py --quick                 # the whole pipeline on a tiny model, ~2 min
    python3 benchmarks/noise_study.py --phase task            # ~15 min
    python3 benchmarks/noise_study.py --phase tune            # 4-7 runs, ~25 min each
    python3 benchmarks/noise_study.py --phase study           # 20 runs, ~30 min each; resumable
    python3 benchmarks/noise_study.py --phase report
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _common
import paired
from real_model import LAST_NUMBER, REAL_ARMS, REAL_SIZES

ARMS = {"grpo": ("grpo_baseline", REAL_ARMS["grpo"]), "grpo_ivon": (None, REAL_ARMS["grpo_ivon"]),
        "c3po": (None, REAL_ARMS["c3po"]), "c3po_lora": (None, ["lora.rank=8", *REAL_ARMS["c3po_lora"]])}
REFERENCE = "grpo"
PAIRS = (("c3po", "grpo_ivon"), ("c3po", "grpo"), ("c3po_lora", "grpo_ivon"))
MOVE_BAND = 0.15  # matched movement: within ±15% of the reference's
PHASES = ("task", "tune", "study", "report")
# asked of every question: without it SmolLM2 writes ~96 tokens a problem (median 85; 51-66% cut at 64
# tokens), with it ~34 (none cut at 256), as right as before (24 problems x 4 samples, d2, T 0.7)
BRIEF = "Answer briefly: give the answer as a single number at the end."
OUT = os.path.join(_common.RESULTS_DIR, "noise_study")


def settings(args) -> list[str]:
    """Every run's settings (the arm's and the step size come after)."""
    held_out = [f"eval.num_items={args.items}", f"eval.samples_per_item={args.samples}", f"eval.k={args.samples}"]
    if args.quick:  # the embedded task on a tiny model: the pipeline, not the figures
        return ["runtime.prompts_per_step=2", "algo.group_size=4", "sampler.max_new_tokens=8",
                f"runtime.steps={args.steps}", "algo.readmit_fraction=0.25", *held_out]
    return [*REAL_SIZES, *LAST_NUMBER, f"prompt.instruction={args.instruction}",
            f"data.path={problems(args, args.difficulty)}", f"sampler.max_new_tokens={args.limit}",
            f"runtime.steps={args.steps}", "algo.readmit_fraction=0.25", *held_out]


def study_key(args) -> dict:
    """What a tuning or study run's figures depend on besides its arm, seed and step size: runs are
    reused (resumed, or their step size taken) only at the same key."""
    return {"difficulty": args.difficulty, "limit": args.limit, "instruction": args.instruction,
            "steps": args.steps, "items": args.items, "samples": args.samples, "quick": args.quick}


def problems(args, difficulty: int) -> str:
    from threepo.services.tasks.word_problems import write_gsm8k

    os.makedirs(_common.RESULTS_DIR, exist_ok=True)
    return write_gsm8k(os.path.join(_common.RESULTS_DIR, f"word_problems_d{difficulty}_{args.problems}.jsonl"),
                       args.problems, difficulty=difficulty)


def model(args) -> str:
    if args.quick:
        return _common.save_tiny(tempfile.mkdtemp(prefix="threepo-noise-study-"))
    from threepo.services.model.modeling import smollm2_checkpoint

    return smollm2_checkpoint(os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo"))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append(path: str, record: dict) -> None:
    """One finished run's record, written at once (a study stopped later keeps it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def evaluate(cfg, path: str, label: str, greedy: bool) -> dict:
    """Held-out figures of the checkpoint at `path`: at the training temperature × the configured
    samples, or greedy × 1; with the per-problem counts."""
    import dataclasses

    from threepo.deploy.commands import evaluate_policy

    if greedy:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, samples_per_item=1, k=1, temperature=0.0))
    # evaluated in the dtype the samplers served in training (bf16 on the real model: ~2x fp32 here)
    served = cfg.model.dtype if cfg.sampler.dtype == "auto" else cfg.sampler.dtype
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=served))
    report = evaluate_policy(cfg, path, label=label)
    return {"pass1": report.pass_at_1, "malformed": report.malformed_rate, "truncated": report.truncated_rate,
            "samples": report.samples_per_item, "correct": list(report.correct)}


def task_phase(args, checkpoint: str) -> None:
    path = os.path.join(args.out, "task.jsonl")
    done = {(r["candidate"], r["instruction"]) for r in records(path)}
    for candidate in args.candidates:
        if (candidate, args.instruction) in done:
            continue
        difficulty, limit = (int(x) for x in candidate.split(":"))
        extra = [f"task.difficulty={difficulty}"] if args.quick else [
            f"data.path={problems(args, difficulty)}", f"sampler.max_new_tokens={limit}"]
        cfg = _common.config(checkpoint, [*settings(args), *extra])
        sampled, greedy = (evaluate(cfg, checkpoint, f"start {candidate}", g) for g in (False, True))
        zero = statistics.fmean(paired.zero_advantage_chance(sampled["samples"], c, args.group)
                                for c in sampled["correct"])
        append(path, {"candidate": candidate, "instruction": args.instruction, "difficulty": difficulty, "limit": limit,
                      "sampled": sampled, "greedy": greedy, "zero_adv_chance": zero, "group": args.group,
                      "commit": commit()})
        print(f"[task] d{difficulty} limit {limit}: pass@1 {sampled['pass1']:.3f} (greedy {greedy['pass1']:.3f}), "
              f"zero-advantage groups of {args.group} {zero:.2f}, truncated {sampled['truncated']:.3f}", flush=True)


def arm_overrides(arm: str, lr: float | None) -> tuple[str | None, list[str]]:
    recipe, extra = ARMS[arm]
    return recipe, [*extra, *([f"optim.lr={lr:g}"] if lr is not None else [])]


def default_lr(arm: str, checkpoint: str, args) -> float:
    recipe, extra = arm_overrides(arm, None)
    return _common.config(checkpoint, [*settings(args), *extra], recipe=recipe).optim.lr


def one_run(arm: str, seed: int, lr: float, checkpoint: str, args, phase: str) -> dict:
    """Train `arm` at step size `lr` with seed `seed`; its record (evaluated when `phase` is the study)."""
    from exploration_study import weight_move

    recipe, extra = arm_overrides(arm, lr)
    # seed s: the prompt order, the exploration's draws and the rollouts' sampling streams (the same in every arm)
    overrides = [*settings(args), *extra, f"seed={seed}", f"algo.seed={seed}", f"sampler.seed={seed}"]
    runs_dir = os.path.join(args.runs, phase, arm, f"s{seed}")
    os.makedirs(runs_dir, exist_ok=True)
    started = time.monotonic()
    run = _common.train_run(checkpoint, overrides, f"{phase} {arm} s{seed} lr {lr:g}", recipe=recipe, runs_dir=runs_dir)
    final, rows = run["summary"]["final_checkpoint"], [r for r in run["rows"] if "reward_mean" in r]
    s = run["summary"]
    out = {"arm": arm, "seed": seed, "lr": lr, "key": study_key(args), "recipe": recipe, "overrides": overrides,
           "commit": commit(),
           "steps": len(rows), "weight_move": weight_move(checkpoint, final),
           "zero_adv_frac": statistics.fmean(r["zero_adv_frac"] for r in rows),
           "malformed_rate": statistics.fmean(r["malformed_rate"] for r in rows),
           "reward_mean": statistics.fmean(r["reward_mean"] for r in rows),
           "retried_dead": s["retried_dead"], "rescued_dead": s["rescued_dead"],
           "curves": {k: [r[k] for r in rows] for k in ("reward_mean", "zero_adv_frac")},
           "run_wall_s": run["run_wall_s"]}
    if phase == "study":
        cfg = _common.config(checkpoint, overrides, runs_dir, recipe)
        out["sampled"], out["greedy"] = (evaluate(cfg, final, f"{arm} s{seed}", g) for g in (False, True))
    out["total_s"] = time.monotonic() - started
    return out


def matching(args, path: str) -> list[dict]:
    """The records in `path` made at this study's key."""
    return [r for r in records(path) if r.get("key") == study_key(args)]


def tuned(args) -> dict[str, float]:
    """Each arm's step size: its last tuning run's at this study's key."""
    return {r["arm"]: r["lr"] for r in matching(args, os.path.join(args.out, "tuning.jsonl"))}


def matched(move: float, target: float) -> bool:
    """Is a movement within ±MOVE_BAND of the reference's?"""
    return abs(move / target - 1) <= MOVE_BAND


def tune_phase(args, checkpoint: str) -> None:
    path = os.path.join(args.out, "tuning.jsonl")
    runs_of = lambda arm: [r for r in matching(args, path) if r["arm"] == arm]  # noqa: E731
    if not runs_of(REFERENCE):
        append(path, one_run(REFERENCE, args.tune_seed, default_lr(REFERENCE, checkpoint, args), checkpoint, args, "tune"))
    target = runs_of(REFERENCE)[-1]["weight_move"]
    print(f"[tune] reference {REFERENCE}: movement {target:.3e}", flush=True)
    if not target > 0:  # e.g. a model that never scores: no advantage, no gradient, nothing to match
        print(f"[tune] the reference did not move: every arm keeps its step size (one run each)", flush=True)
    for arm in (a for a in args.arms if a != REFERENCE):
        runs = runs_of(arm)
        rounds = args.tune_rounds if target > 0 else 1
        while len(runs) < rounds and not (runs and matched(runs[-1]["weight_move"], target)):
            if runs and not runs[-1]["weight_move"] > 0:
                print(f"[tune] {arm} did not move at lr {runs[-1]['lr']:g}: no ratio to scale it by", flush=True)
                break
            lr = runs[-1]["lr"] * target / runs[-1]["weight_move"] if runs else default_lr(arm, checkpoint, args)
            runs.append(one_run(arm, args.tune_seed, lr, checkpoint, args, "tune"))
            append(path, runs[-1])
            print(f"[tune] {arm} lr {lr:g}: movement {runs[-1]['weight_move']:.3e}", flush=True)


def study_phase(args, checkpoint: str) -> None:
    path, lrs = os.path.join(args.out, "runs.jsonl"), tuned(args)
    untuned = [a for a in args.arms if a not in lrs]
    if untuned:
        raise SystemExit(f"noise_study: arms {untuned} have no tuning run at these settings ({study_key(args)}) in "
                         f"{args.out}/tuning.jsonl: run --phase tune first")
    tuning = matching(args, os.path.join(args.out, "tuning.jsonl"))
    target = [r for r in tuning if r["arm"] == REFERENCE][-1]["weight_move"]
    for arm in args.arms:
        move = [r for r in tuning if r["arm"] == arm][-1]["weight_move"]
        if target > 0 and not matched(move, target):
            print(f"[study] {arm}: its step size moved {move / target:.2f}x the reference's in tuning (not matched: "
                  f"more --tune-rounds would tune it further)", flush=True)
    done = {(r["arm"], r["seed"], r["lr"]) for r in matching(args, path)}
    todo = [(arm, seed) for seed in range(args.seeds) for arm in args.arms if (arm, seed, lrs[arm]) not in done]
    started = time.monotonic()
    for i, (arm, seed) in enumerate(todo):
        print(f"\n=== study run {i + 1}/{len(todo)}: {arm} seed {seed} lr {lrs[arm]:g} "
              f"({(time.monotonic() - started) / 60:.0f} min)", flush=True)
        append(path, one_run(arm, seed, lrs[arm], checkpoint, args, "study"))


def report_phase(args) -> None:
    from noise_study_report import write_report

    write_report(args.out, matching(args, os.path.join(args.out, "runs.jsonl")), records(os.path.join(args.out, "task.jsonl")),
                 matching(args, os.path.join(args.out, "tuning.jsonl")), PAIRS, REFERENCE, MOVE_BAND)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--seeds", type=int, default=5, help="study seeds 0..N-1, paired across arms")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--difficulty", type=int, default=2, help="the study's word problems (services/tasks/word_problems.py)")
    p.add_argument("--limit", type=int, default=96, help="sampler.max_new_tokens of the study's runs")
    p.add_argument("--instruction", default=BRIEF, help="prompt.instruction of the study's runs ('' = none)")
    p.add_argument("--candidates", nargs="+", default=["1:64", "2:64", "2:96"], help="task phase: difficulty:limit")
    p.add_argument("--items", type=int, default=128, help="held-out problems")
    p.add_argument("--samples", type=int, default=16, help="held-out samples per problem at T (and one greedy)")
    p.add_argument("--group", type=int, default=8, help="the group size the task phase's zero-advantage chance is for")
    p.add_argument("--problems", type=int, default=2000, help="word problems written (10%% held out)")
    p.add_argument("--tune-seed", type=int, default=100)
    p.add_argument("--tune-rounds", type=int, default=2, help="tuning runs per arm at most")
    p.add_argument("--out", default="", help="the study's files (default benchmarks/results/noise_study)")
    args = p.parse_args()
    if args.quick:
        given = lambda flag: flag in sys.argv  # noqa: E731  (what the command line names stays)
        args.arms = args.arms if given("--arms") else ["grpo", "c3po"]
        args.seeds = args.seeds if given("--seeds") else 2
        args.steps = args.steps if given("--steps") else 2
        args.items, args.samples, args.group, args.tune_rounds = 4, 4, 4, 2
        args.candidates = args.candidates if given("--candidates") else ["1:8"]
    args.out = args.out or (OUT + "_quick" if args.quick else OUT)
    args.runs = os.path.join(_common.RESULTS_DIR, "noise_study_runs" + ("_quick" if args.quick else ""))
    checkpoint = model(args) if set(args.phase) - {"report"} else ""
    for phase in (p for p in PHASES if p in args.phase):
        print(f"\n##### noise study: {phase}", flush=True)
        if phase == "report":
            report_phase(args)
        else:
            {"task": task_phase, "tune": tune_phase, "study": study_phase}[phase](args, checkpoint)


if __name__ == "__main__":
    main()
