"""The report of benchmarks/noise_study.py: per arm pair the paired differences with 95% intervals,
the task and tuning records, and the figure (training reward and zero-advantage groups with bands over
seeds; held-out pass@k against k with 95% bands). Reads the study's records; runs no model."""

from __future__ import annotations

import os
import statistics

import _common
import paired

# (key, label, from the per-problem counts: how to compute it) of each compared figure
FIGURES = (("greedy_pass1", "greedy pass@1", True), ("pass1", "pass@1 (T)", True), ("pass16", "pass@16", True),
           ("zero_adv_frac", "zero-advantage groups (train)", False), ("rescued", "dead groups rescued", False),
           ("malformed_rate", "malformed (train)", False))


def figure_of(run: dict, key: str) -> float:
    """One run's value of a compared figure."""
    if key == "greedy_pass1":
        return run["greedy"]["pass1"]
    if key in ("pass1", "pass16"):
        return passk(run["sampled"], 1 if key == "pass1" else 16)
    if key == "rescued":
        return run["rescued_dead"] / run["retried_dead"] if run["retried_dead"] else float("nan")
    return run[key]


def passk(sampled: dict, k: int) -> float:
    return paired.mean_pass_at_k(sampled["samples"], sampled["correct"], min(k, sampled["samples"]))


def counts_statistic(key: str, samples: int):
    """The statistic of per-problem counts that `key` is (for the bootstrap over problems)."""
    k = 1 if key in ("greedy_pass1", "pass1") else 16
    n = 1 if key == "greedy_pass1" else samples
    return lambda counts: paired.mean_pass_at_k(n, counts, min(k, n))


def comparisons(runs: list[dict], pairs) -> list[dict]:
    """Per (arm A, arm B, figure): the seeds both arms ran, the mean paired difference A − B, its t-interval
    over seeds and, for held-out figures, the bootstrap interval over seeds and problems."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    out = []
    for a, b in pairs:
        seeds = sorted(s for (arm, s) in by if arm == a and (b, s) in by)
        if not seeds:
            continue
        for key, label, from_counts in FIGURES:
            diffs = [figure_of(by[(a, s)], key) - figure_of(by[(b, s)], key) for s in seeds]
            diffs = [d for d in diffs if d == d]
            if not diffs:
                continue
            row = {"a": a, "b": b, "figure": label, "seeds": len(diffs), "t": paired.t_interval(diffs)}
            if from_counts:
                part = "greedy" if key == "greedy_pass1" else "sampled"
                samples = by[(a, seeds[0])]["sampled"]["samples"]
                row["bootstrap"] = paired.bootstrap_interval([by[(a, s)][part]["correct"] for s in seeds],
                                                             [by[(b, s)][part]["correct"] for s in seeds],
                                                             counts_statistic(key, samples))
            out.append(row)
    return out


def _interval(t: tuple[float, float, float]) -> str:
    return f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"


def task_table(tasks: list[dict]) -> list[str]:
    lines = ["**Task candidates** (the start checkpoint; zero-advantage: the chance that a group of G of a problem's "
             "samples is all right or all wrong)", "",
             "| candidate | instruction | pass@1 (T) | greedy pass@1 | zero-advantage groups | truncated | malformed |",
             "|---" * 7 + "|"]
    for t in tasks:
        sampled = t["sampled"]
        lines.append(f"| d{t['difficulty']}, {t['limit']} tokens | {t['instruction'] or 'none'} | {sampled['pass1']:.3f} | "
                     f"{t['greedy']['pass1']:.3f} | {t['zero_adv_chance']:.2f} (G={t['group']}) | "
                     f"{sampled['truncated']:.3f} | {sampled['malformed']:.3f} |")
    return lines


def tuning_table(tuning: list[dict], reference: str, band: float) -> list[str]:
    target = next((r["weight_move"] for r in tuning if r["arm"] == reference), 0.0)
    last = {r["arm"]: i for i, r in enumerate(tuning)}  # an arm's setting is its last tuning run's
    lines = [f"**Tuning** (seed {tuning[0]['seed'] if tuning else '-'}; matched: within ±{band:.0%} of "
             f"{reference}'s movement)", "", f"| arm | optim.lr | ‖θ_T − θ_0‖ / ‖θ_0‖ | × {reference}'s | chosen |",
             "|---" * 5 + "|"]
    for i, r in enumerate(tuning):
        ratio = f"{r['weight_move'] / target:.2f}" if target else "—"
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['weight_move']:.3e} | {ratio} | {'yes' if last[r['arm']] == i else ''} |")
    return lines


def runs_table(runs: list[dict]) -> list[str]:
    lines = ["**Runs** (mean ± std over seeds)", "",
             "| arm | seeds | greedy pass@1 | pass@1 | pass@16 | zero-adv groups | dead rescued | malformed (train) "
             "| movement |", "|---" * 9 + "|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        cells = []
        for key, _, _ in FIGURES:
            values = [v for v in (figure_of(r, key) for r in mine) if v == v]
            cells.append(f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"
                         if values else "—")
        move = statistics.fmean(r["weight_move"] for r in mine)
        lines.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + f" | {move:.2e} |")
    return lines


def comparison_table(rows: list[dict]) -> list[str]:
    lines = ["**Paired differences A − B** (mean over seeds [95% t-interval over seeds]; held-out figures also "
             "[95% bootstrap over seeds and problems, 2,000 resamples])", "",
             "| A − B | figure | seeds | t-interval | bootstrap |", "|---" * 5 + "|"]
    lines += [f"| {r['a']} − {r['b']} | {r['figure']} | {r['seeds']} | {_interval(r['t'])} | "
              f"{_interval(r['bootstrap']) if 'bootstrap' in r else '—'} |" for r in rows]
    return lines


def plot(runs: list[dict], path: str) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    for ax, key, title in ((axes[0], "reward_mean", "training reward"), (axes[1], "zero_adv_frac", "zero-advantage groups")):
        for arm in arms:
            _common.seed_band(ax, [r["curves"][key] for r in runs if r["arm"] == arm], arm)
        ax.set_title(f"{title} (mean ± std over seeds)", fontsize="small")
        ax.set_xlabel("step")
    axes[0].legend(fontsize="x-small")
    ax = axes[2]
    for arm in arms:
        mine = [r["sampled"] for r in runs if r["arm"] == arm]
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= mine[0]["samples"]]
        per_seed = np.array([[passk(s, k) for k in ks] for s in mine])
        mean = per_seed.mean(0)
        half = (paired.t975(len(mine) - 1) * per_seed.std(0, ddof=1) / np.sqrt(len(mine))) if len(mine) > 1 else 0 * mean
        (line,) = ax.plot(ks, mean, marker="o", label=arm)
        ax.fill_between(ks, mean - half, mean + half, color=line.get_color(), alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_title("held-out pass@k (95% t-band over seeds)", fontsize="small")
    ax.legend(fontsize="x-small")
    figure.savefig(path, dpi=110)


def write_report(out: str, runs: list[dict], tasks: list[dict], tuning: list[dict], pairs, reference: str,
                 band: float) -> None:
    """report.md (the four tables) and, once there are runs, figure.png in `out`."""
    parts = [task_table(tasks), tuning_table(tuning, reference, band)]
    if runs:
        parts += [runs_table(runs), comparison_table(comparisons(runs, pairs))]
    text = "\n\n".join("\n".join(part) for part in parts) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    if runs:
        plot(runs, os.path.join(out, "figure.png"))
    print(f"report: {os.path.join(out, 'report.md')}" + (f", {os.path.join(out, 'figure.png')}" if runs else ""))
