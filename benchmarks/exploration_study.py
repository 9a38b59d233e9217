"""Exploration study (issue 13): does parameter-space exploration learn more where GRPO stalls?

Arms, all at equal rollouts (same steps, prompts per step and G; M3PO with equal compute):
- grpo: `--config grpo_baseline` (AdamW, no noise); entropy: + algo.entropy_coef=5e-3;
  temperature: + sampler.temperature=1.2 (the action-space baselines of 3PO);
- c3po (the default: IVON, N = 4 slots in one group), b3po (one slot), m3po (4 slots, a group each);
- c3po_dead: C3PO with dead-group-aware exploration, a prompt whose rollouts all failed comes back
  with every slot's σ × `--dead-scale` (algo.dead_group_scale).
Every arm re-admits dead prompts the same way (algo.readmit_fraction = `--readmit`, a plain retry
at the same σ, at the mean for grpo), so "rescued" is measured identically everywhere and only
c3po_dead changes the noise: a dead prompt is rescued when its re-admission (a new group of a later
step) has at least one successful rollout; the rate is rescued / re-admissions of dead prompts
(the ledger's `rescued_dead` / `retried_dead`). Tasks: the embedded default (arith, difficulty 2)
and `--config countdown_hard` (countdown with four numbers, bootstrapped to pass@1 0.05: most GRPO
groups are all-fail). Per run: held-out pass@1 and pass@k of the final checkpoint (as `threepo eval`
measures it, services/evaluation.py), pass@1 on every difficulty tier of the family, the mean
zero-advantage group fraction and malformed rate of training, and the rescue rate; per arm the mean
± std over seeds. MoE part: VP2O (`--config vp2o_moe`) against GRPO and plain C3PO on the same
embedded MoE: held-out pass@1 and expert-output diversity 1 − L_orth (mean squared cosine between
the outputs of each token's selected experts, algorithms.moe.expert_orthogonality_loss, on held-out
prompts). Real-model task (`--tasks smollm2`, issue 25): SmolLM2-135M-Instruct (its wheel's GGUF,
converted) on GSM8K-shaped word problems threepo writes, as benchmarks/real_model.py trains it (chat
template, answers scored by their last number, T 0.7, bf16), `--real-steps` steps x 8 prompts x 8
rollouts x 64 tokens, each arm's optimizer sized so a step moves a weight about as far (`REAL_ARMS`);
runs seed by seed; per run held-out pass@k for k = 1, 4, 16, 64 (32 items x 64 samples at T 0.7),
the malformed rates, zero-advantage groups and ‖θ_final − θ_start‖ / ‖θ_start‖; the start checkpoint
evaluated the same way. Targets (issue 13, task where GRPO stalls): C3PO ≥ GRPO + 0.02 held-out pass@1 and ≥ 30%
fewer zero-advantage groups; c3po_dead rescues ≥ 10% of dead groups where GRPO rescues < 5%.

Writes benchmarks/results/exploration_study.{json,md,png} (exploration_study_quick.* with
`--quick`; the .md table is the one for benchmarks/README.md); run directories with final
checkpoints under results/exploration_study/.
`--resume` skips the runs already in the JSON file (a long study can be stopped and continued).

    python3 benchmarks/exploration_study.py --quick    # smoke: a few minutes on 2 cores
    python3 benchmarks/exploration_study.py            # full: 5 seeds x 2 tasks x 7 arms + MoE (hours)
    python3 benchmarks/exploration_study.py --tasks smollm2 --arms grpo c3po --moe-arms --seeds 3   # ~2 h
    python3 benchmarks/exploration_study.py --tasks smollm2 --arms grpo grpo_lora c3po_lora --moe-arms \
        --seeds 1 --resume   # LoRA (issue 26) beside the runs above
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import tomllib

import _common
from real_model import LAST_NUMBER, REAL_ARMS, REAL_SIZES

ARMS = {  # name -> (recipe, overrides)
    "grpo": ("grpo_baseline", []),
    "entropy": ("grpo_baseline", ["algo.entropy_coef=5e-3"]),
    "temperature": ("grpo_baseline", ["sampler.temperature=1.2"]),
    "b3po": (None, ["algo.exploration=b3po", "algo.n_slots=1"]),
    "m3po": (None, ["algo.exploration=m3po", "algo.n_slots=4"]),
    "c3po": (None, []),
    "c3po_dead": (None, []),  # + algo.dead_group_scale (--dead-scale)
    "grpo_lora": ("grpo_baseline", ["lora.rank=8"]),  # issue 26: rank-8 adapters, AdamW
    "c3po_lora": (None, ["lora.rank=8"]),  # an IVON posterior over rank-8 adapters
}
TASKS = {"arith": None, "countdown_hard": "countdown_hard", "smollm2": None}  # name -> task recipe
# The real-model task: SmolLM2-135M-Instruct on word problems (benchmarks/real_model.py's learning part:
# chat template, answers scored by their last number, T 0.7, bf16), held-out pass@k at T 0.7.
REAL = "smollm2"
DIFFICULTIES = {"arith": (1, 2, 3), "countdown": (1, 2)}
MOE_ARMS = {"grpo_moe": ("grpo_baseline", ["model.kind=moe"]), "c3po_moe": (None, ["model.kind=moe"]),
            "vp2o": ("vp2o_moe", [])}
STALLS = "countdown_hard"  # the task where GRPO stalls (targets)
OUT = os.path.join(_common.RESULTS_DIR, "exploration_study")


def recipe_overrides(recipe: str | None) -> list[str]:
    """A shipped recipe as `section.field=value` overrides (so a task recipe and an arm recipe compose)."""
    if recipe is None:
        return []
    from threepo.deploy.config import resolve_recipe

    with open(resolve_recipe(recipe), "rb") as f:
        tree = tomllib.load(f)
    value = lambda v: json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)  # noqa: E731
    return [f"{section}.{key}={value(v)}" for section, table in tree.items() if isinstance(table, dict)
            for key, v in table.items()]


def expert_diversity(path: str, cfg) -> float:
    """1 − L_orth of the checkpoint at `path` over held-out prompts (see the module docstring)."""
    import torch

    from threepo.services.learner.vp2o import VP2OConfig, VP2OHooks
    from threepo.services.model.modeling import load_model, load_tokenizer
    from threepo.services.tasks.datasets import eval_items

    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    hooks = VP2OHooks(model, VP2OConfig())
    encoded = [tokenizer(it.prompt + it.answer, add_special_tokens=False)["input_ids"] for it in eval_items(cfg.data, cfg.task, cfg.eval)[:128]]
    ids = torch.zeros(len(encoded), max(map(len, encoded)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, :len(e)], mask[i, :len(e)] = torch.tensor(e), 1
    with torch.no_grad(), hooks.capture(mask):
        model(input_ids=ids, attention_mask=mask)
    return 1.0 - hooks.extra_loss()[1]["vp2o_l_orth"]


def one_run(task: str, arm: str, seed: int, model: str, recipe: str | None, overrides: list[str], args) -> dict:
    """Train one arm, evaluate its final checkpoint on the task's held-out tier and every tier."""
    from threepo.deploy.commands import evaluate_policy
    from threepo.services.tasks.synthetic import max_new_tokens_for

    runs_dir = os.path.join(OUT, task, arm, f"s{seed}")
    os.makedirs(runs_dir, exist_ok=True)
    started = time.monotonic()
    run = _common.train_run(model, overrides, f"{task}/{arm}/s{seed}", recipe=recipe, heldout=True, runs_dir=runs_dir)
    cfg = _common.config(model, overrides, runs_dir, recipe)
    final, rows = run["summary"]["final_checkpoint"], [r for r in run["rows"] if "reward_mean" in r]
    tiers = {}
    for d in () if task == REAL else DIFFICULTIES.get(cfg.task.family, ()):  # REAL: a data file, no tiers
        if d == cfg.task.difficulty:
            tiers[d] = run["heldout"]["pass_at_1"]
            continue
        # the trained limit or the tier's, whichever is longer: a capability, not a cut at a shorter limit
        limit = max(cfg.sampler.max_new_tokens, max_new_tokens_for(cfg.task.family, d))
        tier_cfg = _common.config(model, [*overrides, f"task.difficulty={d}", f"sampler.max_new_tokens={limit}"],
                                  runs_dir, recipe)
        tiers[d] = evaluate_policy(tier_cfg, final, label=f"d{d}").pass_at_1
    s = run["summary"]
    out = {"task": task, "arm": arm, "seed": seed, "pass1": run["heldout"]["pass_at_1"],
           "passk": run["heldout"]["pass_at_k"], "k": run["heldout"]["k"],
           "eval_malformed": run["heldout"]["malformed_rate"],
           "zero_adv_frac": statistics.mean(r["zero_adv_frac"] for r in rows),
           "malformed_rate": statistics.mean(r["malformed_rate"] for r in rows),
           "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
           "retried_dead": s["retried_dead"], "rescued_dead": s["rescued_dead"],
           "rescue_rate": s["rescued_dead"] / s["retried_dead"] if s["retried_dead"] else float("nan"),
           "dead_prompts": s["dead_prompts"], "consumed_rollouts": s["consumed_rollouts"],
           "pass1_by_difficulty": {str(d): p for d, p in tiers.items()}, "run_wall_s": run["run_wall_s"],
           "startup_s": run["startup_s"], "steps": len(rows), "total_s": time.monotonic() - started,
           "curves": {k: [r[k] for r in rows] for k in ("reward_mean", "zero_adv_frac")}}
    out["passk_curve"] = passk_curve(run["heldout"])
    if task == REAL:
        out["weight_move"] = weight_move(model, final)
    if cfg.model.kind == "moe":
        out["expert_diversity"] = expert_diversity(final, cfg)
    return out


def passk_curve(report: dict) -> dict[str, float]:
    """pass@k at k = 1, 4, 16, 64 (those ≤ the samples per item) from an evaluation's per-item counts."""
    from threepo.services.evaluation import EvalReport

    report = EvalReport(**{**report, "correct": tuple(report["correct"])})
    return {str(k): report.pass_at(k) for k in (1, 4, 16, 64) if k <= report.samples_per_item}


def start_point(args, cache: dict) -> dict:
    """The real-model task's starting checkpoint, evaluated as the runs' final ones are."""
    from threepo.deploy.commands import evaluate_policy

    model = model_for(REAL, args, cache)
    report = evaluate_policy(_common.config(model, [*args.sizes, *args.real, *args.overrides]), model,
                             label=f"{REAL} start").__dict__
    return {"pass1": report["pass_at_1"], "eval_malformed": report["malformed_rate"], "passk_curve": passk_curve(report)}


def plan(args) -> list[tuple]:
    """(task, arm, seed, model-config recipe, arm recipe, overrides) of every run of the study."""
    common = [f"runtime.steps={args.steps}", f"algo.readmit_fraction={args.readmit}", *args.sizes, *args.overrides]
    runs = []
    for task in args.tasks:
        for arm in args.arms:
            recipe, extra = ARMS[arm]
            extra = [*extra, f"algo.dead_group_scale={args.dead_scale}"] if arm == "c3po_dead" else extra
            if task == REAL:  # its settings after the study's (its own steps and sizes), the user's last
                extra = [*extra, *REAL_ARMS.get(arm, []), *common, f"runtime.steps={args.real_steps}",
                         *args.real, *args.overrides]
            for seed in args.seed_list:
                runs.append((task, arm, seed, REAL if task == REAL else TASKS[task], recipe,
                             [*recipe_overrides(TASKS[task]), *extra, *([] if task == REAL else common),
                              f"seed={seed}", f"algo.seed={seed}"]))
    if REAL in args.tasks:  # seed by seed, so that a study stopped early has every arm at the seeds it ran
        real = sorted((r for r in runs if r[0] == REAL), key=lambda r: r[2])
        runs = [r for r in runs if r[0] != REAL] + real
    for arm in args.moe_arms:
        recipe, extra = MOE_ARMS[arm]
        for seed in args.seed_list[:args.moe_seeds]:
            runs.append(("moe", arm, seed, "vp2o_moe", recipe, [*extra, *common, f"seed={seed}", f"algo.seed={seed}"]))
    return runs


def real_overrides(args) -> list[str]:
    """The word-problem file (written once, 10% held out) and the real-model task's settings."""
    from threepo.services.tasks.word_problems import write_gsm8k

    os.makedirs(_common.RESULTS_DIR, exist_ok=True)
    data = write_gsm8k(os.path.join(_common.RESULTS_DIR, f"word_problems_d1_{args.problems}.jsonl"), args.problems,
                       difficulty=1)
    return [f"data.path={data}", *REAL_SIZES, *LAST_NUMBER, *args.real_sizes]


def weight_move(start: str, final: str) -> float:
    """‖θ_final − θ_start‖ / ‖θ_start‖ over every tensor of two checkpoints: how far training went."""
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (start, final))
    moved = sum(float((b[k].float() - a[k].float()).square().sum()) for k in a if k in b)
    return (moved / sum(float(t.float().square().sum()) for t in a.values())) ** 0.5 if a else float("nan")


def model_for(model_recipe: str | None, args, cache: dict) -> str:
    """The bootstrapped checkpoint of a task (cached by threepo), or a random tiny one for --model tiny
    (and for the MoE part of --quick, which would otherwise bootstrap the MoE first)."""
    if model_recipe not in cache:
        if model_recipe == REAL and args.model != "tiny":
            from threepo.services.model.modeling import smollm2_checkpoint

            cache[model_recipe] = smollm2_checkpoint(
                os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo"))
        elif args.model == "tiny" or (args.quick and model_recipe == "vp2o_moe"):
            cache[model_recipe] = save_tiny_moe() if model_recipe == "vp2o_moe" else _common.save_tiny(_tmp())
        else:
            from threepo.deploy.commands import policy_path
            from threepo.deploy.config import load_config

            cache[model_recipe] = policy_path(load_config(model_recipe))
    return cache[model_recipe]


def _tmp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="threepo-study-tiny-")


def save_tiny_moe() -> str:
    """A random tiny Qwen2-MoE (4 experts, top-2), as tests/conftest.py builds it: smoke runs only."""
    from threepo.services.model.modeling import ModelConfig, build_model
    from threepo.services.model.tokenizer import build_tokenizer

    directory, tokenizer = _tmp(), build_tokenizer()
    cfg = ModelConfig(kind="moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                      num_experts=4, experts_per_token=2, expert_intermediate_size=32)
    build_model(cfg, vocab_size=72, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def aggregate(results: list[dict]) -> dict:
    """(task, arm) -> mean and std over seeds of every scalar figure."""
    keys = ("pass1", "passk", "zero_adv_frac", "rescue_rate", "malformed_rate", "eval_malformed", "reward_mean",
            "expert_diversity", "weight_move")
    out = {}
    for r in results:
        out.setdefault((r["task"], r["arm"]), []).append(r)
    table = {}
    for (task, arm), runs in out.items():
        row = {"n": len(runs), "k": runs[0]["k"]}
        for key in keys:
            values = [r[key] for r in runs if key in r and r[key] == r[key]]
            if values:
                row[key] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
        tiers = sorted({d for r in runs for d in r["pass1_by_difficulty"]})
        row["tiers"] = {d: statistics.mean(r["pass1_by_difficulty"][d] for r in runs) for d in tiers}
        ks = [k for k in runs[0].get("passk_curve", {}) if all(k in r.get("passk_curve", {}) for r in runs)]
        row["curve"] = {k: (statistics.mean(r["passk_curve"][k] for r in runs),
                            statistics.stdev(r["passk_curve"][k] for r in runs) if len(runs) > 1 else 0.0) for k in ks}
        table[(task, arm)] = row
    return table


def markdown(table: dict) -> str:
    """The table for benchmarks/README.md: mean ± std over seeds."""
    fmt = lambda row, key: f"{row[key][0]:.3f} ± {row[key][1]:.3f}" if key in row else "—"  # noqa: E731
    lines = ["| task | arm | seeds | held-out pass@1 | pass@k | zero-adv groups | dead rescued | malformed (train) "
             "| pass@1 by difficulty | expert diversity |", "|---" * 10 + "|"]
    for (task, arm), row in table.items():
        tiers = ", ".join(f"d{d} {p:.3f}" for d, p in row["tiers"].items())
        lines.append(f"| {task} | {arm} | {row['n']} | {fmt(row, 'pass1')} | {fmt(row, 'passk')} (k={row['k']}) | "
                     f"{fmt(row, 'zero_adv_frac')} | {fmt(row, 'rescue_rate')} | {fmt(row, 'malformed_rate')} | "
                     f"{tiers} | {fmt(row, 'expert_diversity')} |")
    return "\n".join(lines)


def targets(table: dict) -> list[str]:
    """The issue's targets on the task where GRPO stalls, each with what the data show."""
    get = lambda arm, key: table.get((STALLS, arm), {}).get(key, (float("nan"), 0.0))[0]  # noqa: E731
    lines = []
    if (STALLS, "grpo") in table and (STALLS, "c3po") in table:
        gain, zero = get("c3po", "pass1") - get("grpo", "pass1"), 1 - get("c3po", "zero_adv_frac") / get("grpo", "zero_adv_frac")
        lines.append(f"c3po - grpo held-out pass@1: {gain:+.3f} (target >= +0.020): {'met' if gain >= 0.02 else 'not met'}")
        lines.append(f"c3po zero-advantage groups vs grpo: {zero:+.0%} fewer (target >= 30%): {'met' if zero >= 0.3 else 'not met'}")
    if (STALLS, "c3po_dead") in table and (STALLS, "grpo") in table:
        dead, grpo = get("c3po_dead", "rescue_rate"), get("grpo", "rescue_rate")
        lines.append(f"dead groups rescued: c3po_dead {dead:.1%} (target >= 10%), grpo {grpo:.1%} (target < 5%): "
                     f"{'met' if dead >= 0.1 and grpo < 0.05 else 'not met'}")
    return lines


def real_markdown(table: dict, start: dict | None) -> str:
    """The real-model task's table: held-out pass@k (k = 1 … 64) per arm, mean ± std over seeds."""
    rows = {arm: row for (task, arm), row in table.items() if task == REAL}
    ks = list(next(iter(rows.values()))["curve"])
    fmt = lambda row, key: f"{row[key][0]:.3f} ± {row[key][1]:.3f}" if key in row else "—"  # noqa: E731
    lines = [f"| {REAL} | seeds | " + " | ".join(f"pass@{k}" for k in ks) +
             " | malformed (held-out) | malformed (train) | zero-adv groups | weight move ‖Δθ‖/‖θ‖ |",
             "|---" * (len(ks) + 6) + "|"]
    if start:
        lines.append("| start checkpoint | - | " + " | ".join(f"{start['passk_curve'][k]:.3f}" for k in ks) +
                     f" | {start['eval_malformed']:.3f} | - | - | - |")
    for arm, row in rows.items():
        curve = " | ".join(f"{row['curve'][k][0]:.3f} ± {row['curve'][k][1]:.3f}" for k in ks)
        move = f"{row['weight_move'][0]:.2e}" if "weight_move" in row else "—"
        lines.append(f"| {arm} | {row['n']} | {curve} | {fmt(row, 'eval_malformed')} | {fmt(row, 'malformed_rate')} "
                     f"| {fmt(row, 'zero_adv_frac')} | {move} |")
    return "\n".join(lines)


def real_targets(table: dict) -> list[str]:
    """Issue 25's study targets on the real model, each with what the data show."""
    if (REAL, "grpo") not in table or (REAL, "c3po") not in table:
        return []
    grpo, c3po = table[(REAL, "grpo")], table[(REAL, "c3po")]
    gap = c3po["pass1"][0] - grpo["pass1"][0]
    bad, zero = c3po["malformed_rate"][0], c3po["zero_adv_frac"][0]
    last = list(c3po["curve"])[-1]
    return [f"{REAL}: c3po - grpo held-out pass@1 {gap:+.3f} (target >= 0): {'met' if gap >= 0 else 'not met'}",
            f"{REAL}: c3po training malformed {bad:.3f} vs grpo {grpo['malformed_rate'][0]:.3f} x 1.1 = "
            f"{grpo['malformed_rate'][0] * 1.1:.3f}: {'met' if bad <= grpo['malformed_rate'][0] * 1.1 else 'not met'}",
            f"{REAL}: zero-advantage groups c3po {zero:.3f} vs grpo {grpo['zero_adv_frac'][0]:.3f}: "
            f"{'fewer (met)' if zero < grpo['zero_adv_frac'][0] else 'not fewer (not met)'}",
            f"{REAL}: pass@{last} c3po {c3po['curve'][last][0]:.3f} vs grpo {grpo['curve'][last][0]:.3f} "
            f"({c3po['curve'][last][0] - grpo['curve'][last][0]:+.3f})"]


def plot(results: list[dict], table: dict, path: str, start: dict | None = None) -> None:
    """Per task: training reward and zero-advantage fraction (mean over seeds, band ±1 std, smoothed
    as deploy/report.py smooths), and held-out pass@1 and rescue rate per arm (±1 std)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from threepo.deploy.report import POINTS_PER_HALF_WINDOW, smoothed

    tasks = list(dict.fromkeys(r["task"] for r in results))
    figure = Figure(figsize=(18, 3.6 * len(tasks)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(tasks), 4, squeeze=False)
    for row, task in zip(axes, tasks):
        arms = list(dict.fromkeys(r["arm"] for r in results if r["task"] == task))
        for ax, key, title in ((row[0], "reward_mean", "training reward"), (row[1], "zero_adv_frac", "zero-advantage groups")):
            for arm in arms:
                curves = [r["curves"][key] for r in results if (r["task"], r["arm"]) == (task, arm)]
                n = min(map(len, curves))
                _common.seed_band(ax, [smoothed(c[:n], n // POINTS_PER_HALF_WINDOW) for c in curves], arm)
            ax.set_title(f"{task}: {title} (mean ± std over seeds)", fontsize="small")
            ax.set_xlabel("step")
        row[0].legend(fontsize="x-small")
        last = ("expert_diversity", "expert-output diversity 1 − L_orth") if task == "moe" else \
            ("rescue_rate", "dead groups rescued")
        panels = ((row[2], ("pass1", "held-out pass@1")), (row[3], last))
        if task == REAL:  # pass@k against k instead of the rescue rate
            panels = panels[:1]
            ax = row[3]
            for arm in arms:
                curve = table[(task, arm)]["curve"]
                ks = [int(k) for k in curve]
                ax.errorbar(ks, [curve[k][0] for k in curve], yerr=[curve[k][1] for k in curve], capsize=3,
                            marker="o", label=arm)
            if start:
                ax.plot([int(k) for k in start["passk_curve"]], list(start["passk_curve"].values()), "k--",
                        marker=".", label="start")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("k")
            ax.legend(fontsize="x-small")
            ax.set_title(f"{task}: held-out pass@k (±1 std over seeds)", fontsize="small")
        for ax, (key, title) in panels:
            present = [a for a in arms if key in table[(task, a)]]
            ax.bar(range(len(present)), [table[(task, a)][key][0] for a in present],
                   yerr=[table[(task, a)][key][1] for a in present], capsize=4)
            ax.set_xticks(range(len(present)), present, rotation=30, fontsize="x-small")
            ax.set_title(f"{task}: {title} (±1 std)", fontsize="small")
    figure.savefig(path, dpi=110)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--arms", nargs="+", default=[a for a in ARMS if not a.endswith("_lora")], choices=list(ARMS))
    p.add_argument("--moe-arms", nargs="*", default=list(MOE_ARMS), choices=list(MOE_ARMS))
    p.add_argument("--moe-seeds", type=int, default=5, help="seeds of the MoE part (the first N of --seeds)")
    p.add_argument("--readmit", type=float, default=0.25, help="algo.readmit_fraction of every arm")
    p.add_argument("--dead-scale", type=float, default=2.0, help="algo.dead_group_scale of c3po_dead")
    p.add_argument("--resume", action="store_true", help="skip the runs already in the results file")
    p.add_argument("--real-steps", type=int, default=10, help=f"steps of the {REAL} task's runs")
    p.add_argument("--problems", type=int, default=2000, help=f"word problems written for {REAL} (10%% held out)")
    args = p.parse_args()
    args.sizes, args.real_sizes = [], []
    if args.quick:  # 3 arms x 2 seeds on countdown_hard and 2 MoE runs, small steps and evaluations
        given = lambda flag: flag in sys.argv  # noqa: E731  (what the command line names stays)
        args.seeds = args.seeds if given("--seeds") else 2
        args.steps, args.moe_seeds = 6, 1
        args.tasks = args.tasks if given("--tasks") else ["countdown_hard"]
        args.arms = args.arms if given("--arms") else ["grpo", "c3po", "c3po_dead"]
        args.moe_arms = args.moe_arms if given("--moe-arms") else ["grpo_moe", "vp2o"]
        args.sizes = ["runtime.prompts_per_step=4", "algo.group_size=8", "eval.num_items=32",
                      "eval.samples_per_item=4", "eval.k=4"]
        args.real_steps, args.problems = 2, 200
        args.real_sizes = ["runtime.prompts_per_step=2", "algo.group_size=4", "sampler.max_new_tokens=16",
                           "eval.num_items=4", "eval.samples_per_item=4", "eval.k=4"]
    args.seed_list = list(range(args.seeds))
    path = _common.results_path("exploration_study", args.quick)
    results, start = [], None
    if args.resume and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        results, start = saved["runs"], saved.get("start")
    done, cache, failed, started = {(r["task"], r["arm"], r["seed"]) for r in results}, {}, {}, time.monotonic()
    args.real = real_overrides(args) if REAL in args.tasks else []  # the word-problem file written once
    if REAL in args.tasks and start is None:
        start = start_point(args, cache)
    todo, new = [r for r in plan(args) if r[:3] not in done], []
    for i, (task, arm, seed, model_recipe, recipe, overrides) in enumerate(todo):
        print(f"\n=== run {i + 1}/{len(todo)}: {task} / {arm} / seed {seed} ({time.monotonic() - started:.0f} s)", flush=True)
        try:
            results.append(one_run(task, arm, seed, model_for(model_recipe, args, cache), recipe, overrides, args))
            new.append(results[-1])
        except Exception as err:  # one broken run must not lose the others' figures
            failed[f"{task}/{arm}/s{seed}"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
            print(f"[{task}/{arm}/s{seed}] FAILED: {failed[f'{task}/{arm}/s{seed}']}", flush=True)
        _common.write_results("exploration_study", {"runs": results, "start": start, "failed": failed,
                                                    "args": vars(args)})
    wall = time.monotonic() - started
    if not results:
        raise SystemExit(f"every run failed: {failed}")
    table = aggregate(results)
    embedded = {key: row for key, row in table.items() if key[0] != REAL}
    text = markdown(embedded) if embedded else ""
    lines = targets(table)
    if any(key[0] == REAL for key in table):
        text = (text + "\n\n" if text else "") + real_markdown(table, start)
        lines += real_targets(table)
    print("\n" + text + "\n\n" + "\n".join(lines))
    with open(_common.results_path("exploration_study", args.quick, "md"), "w") as f:
        f.write(text + "\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    plot(results, table, _common.results_path("exploration_study", args.quick, "png"), start)
    print(f"\n{len(todo)} runs in {wall / 60:.1f} min; figures in {_common.results_path('exploration_study', args.quick, '*')}")
    for r in new:
        loop = r["run_wall_s"] / r["steps"]
        print(f"  {r['task']}/{r['arm']}/s{r['seed']}: {loop:.2f} s/step, start-up {r['startup_s']:.0f} s, "
              f"evaluations {r['total_s'] - r['run_wall_s'] - r['startup_s']:.0f} s")


if __name__ == "__main__":
    main()
