"""End-of-run report: PNG plots and a short markdown summary from `run_dir/metrics.jsonl`.

Each line of metrics.jsonl is one JSON object, usually one per learner step. Known keys are plotted
when present and skipped when absent; a key may be missing or null on some lines (held-out pass@1
is evaluated every few steps only). The x axis is `step` when the records have it, else the line
number. Figures: reward, held-out pass@1, zero-advantage group fraction, rescued groups, malformed
rate, staleness (mean and max), sync events as vertical markers coloured by reason, and tokens/s
per engine (every `tokens_per_s/<engine>` key). `report.png` puts them all on one grid and
`report.md` lists them with a first-vs-last table of every numeric key.

A dense series (a value on at least half the records) of 40 points or more is drawn faint as
recorded, with a centred moving average over ±len/40 points on top in the same colour. A sparse
series (held-out evaluations every few steps) is drawn as points; held-out pass@1 points carry
their binomial standard error sqrt(p(1 − p)/n) when the record has `heldout_n` (the number of
items evaluated), and plain points without it.

matplotlib is used through its object API on the Agg canvas, so no pyplot state or display is
touched and importing this module costs nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (file stem, title, keys plotted as lines); sync events and tokens/s are drawn separately.
LINE_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward (mean)", ("reward_mean",)),
    ("heldout_pass1", "Held-out pass@1", ("heldout_pass1",)),
    ("zero_adv_frac", "Zero-advantage group fraction", ("zero_adv_frac",)),
    ("rescued_groups", "Rescued groups", ("rescued_groups",)),
    ("malformed_rate", "Malformed rollout rate", ("malformed_rate",)),
    ("staleness", "Staleness (learner steps)", ("staleness_mean", "staleness_max")),
)
TOKENS_PREFIX = "tokens_per_s/"
HELDOUT_N = "heldout_n"  # items behind a record's held-out pass@1 (one sample each)
POINTS_PER_HALF_WINDOW = 40  # smoothing half-width = len(series) // this (0: not smoothed)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a bad line raises ValueError naming file and line."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _x(records: list[dict[str, Any]], i: int) -> float:
    return records[i].get("step", i)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(_x(records, i), r[key]) for i, r in enumerate(records)
              if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
    return [p[0] for p in points], [p[1] for p in points]


def smoothed(values: list[float], half_width: int) -> list[float]:
    """Centred moving average: value i becomes the mean of values[i − h .. i + h], the window cut
    at both ends (no lag, no padding); h = 0 returns the values unchanged."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half_width): i + half_width + 1]
        out.append(sum(window) / len(window))
    return out


def _heldout_se(record: dict[str, Any], p: float) -> float | None:
    """Binomial standard error of a held-out pass@1 over the record's `heldout_n` items, if known."""
    n = record.get(HELDOUT_N)
    if not isinstance(n, int | float) or isinstance(n, bool) or n <= 0:
        return None
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def _points(ax: Any, records: list[dict[str, Any]], key: str, label: str) -> None:
    """A sparse series as points; held-out ones with ±1 standard error where n is recorded."""
    rows = [(_x(records, i), r[key], _heldout_se(r, r[key]) if key.startswith("heldout_") else None)
            for i, r in enumerate(records) if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
    known = [row for row in rows if row[2] is not None]
    colour = None
    if known:
        bars = ax.errorbar([x for x, _, _ in known], [y for _, y, _ in known], yerr=[e for _, _, e in known],
                           fmt="o-", markersize=4, capsize=3, label=f"{label} (±1 s.e.)")
        colour = bars.lines[0].get_color()
    unknown = [row for row in rows if row[2] is None]
    if unknown:
        ax.plot([x for x, _, _ in unknown], [y for _, y, _ in unknown], "o", markersize=4, color=colour,
                label=None if known else label)


def _line_panel(records: list[dict[str, Any]], keys: tuple[str, ...]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        for key in keys:
            xs, ys = _series(records, key)
            label = key.removeprefix(TOKENS_PREFIX)
            half = len(xs) // POINTS_PER_HALF_WINDOW
            if not xs:
                continue
            if 2 * len(xs) < len(records):
                _points(ax, records, key, label)
            elif half:
                (raw,) = ax.plot(xs, ys, linewidth=0.8, alpha=0.3)
                ax.plot(xs, smoothed(ys, half), color=raw.get_color(), label=label)
            else:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        if len(keys) > 1:
            ax.legend(fontsize="small")
    return draw


def _sync_panel(records: list[dict[str, Any]]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        from matplotlib import colormaps

        events = [(_x(records, i), r.get("sync_reason") or "unspecified")
                  for i, r in enumerate(records) if r.get("sync_event")]
        reasons = sorted({reason for _, reason in events})
        colours = colormaps["tab10"]
        for k, reason in enumerate(reasons):
            xs = [x for x, r in events if r == reason]
            for j, x in enumerate(xs):
                ax.axvline(x, color=colours(k % 10), linewidth=1.5,
                           label=f"{reason} ({len(xs)})" if j == 0 else None)
        xs_all = [_x(records, i) for i in range(len(records))]
        ax.set_xlim(min(xs_all), max(xs_all) if max(xs_all) > min(xs_all) else min(xs_all) + 1)
        ax.set_yticks([])
        if reasons:
            ax.legend(fontsize="small", title="reason", title_fontsize="small", framealpha=0.95)
        else:
            ax.text(0.5, 0.5, "no sync events", transform=ax.transAxes, ha="center", va="center")
    return draw


def _panels(records: list[dict[str, Any]]) -> list[tuple[str, str, Callable[[Any], None]]]:
    """(file stem, title, draw(ax)) for every figure whose keys occur in the records."""
    present = {k for r in records for k, v in r.items() if v is not None}
    panels = [(stem, title, _line_panel(records, tuple(k for k in keys if k in present)))
              for stem, title, keys in LINE_PANELS if any(k in present for k in keys)]
    if "sync_event" in present:
        panels.append(("sync_events", "Sync events by reason", _sync_panel(records)))
    engines = tuple(sorted(k for k in present if k.startswith(TOKENS_PREFIX)))
    if engines:
        panels.append(("tokens_per_s", "Generated tokens/s per engine", _line_panel(records, engines)))
    return panels


def _figure(rows: int, cols: int, width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _style(ax: Any, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel(xlabel, fontsize="small")
    ax.grid(alpha=0.3)


def make_report(run_dir: str | Path) -> list[Path]:
    """Write one PNG per present figure, `report.png` (all of them on a grid) and `report.md` into
    `run_dir`; return the PNG paths (overview last). Raises ValueError if metrics.jsonl has no records."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no records to report")
    xlabel = "learner step" if "step" in records[0] else "record"
    panels = _panels(records)
    written = []
    for stem, title, draw in panels:
        figure = _figure(1, 1, 6.4, 3.6)
        ax = figure.add_subplot()
        draw(ax)
        _style(ax, title, xlabel)
        written.append(run_dir / f"{stem}.png")
        figure.savefig(written[-1], dpi=100)
    if panels:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        overview = _figure(rows, cols, 5.0, 3.2)
        for k, (_, title, draw) in enumerate(panels):
            ax = overview.add_subplot(rows, cols, k + 1)
            draw(ax)
            _style(ax, title, xlabel)
        written.append(run_dir / "report.png")
        overview.savefig(written[-1], dpi=100)
    (run_dir / "report.md").write_text(_markdown(records, panels, xlabel))
    return written


def _markdown(records: list[dict[str, Any]], panels: list, xlabel: str) -> str:
    numeric = sorted({k for r in records for k, v in r.items()
                      if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"})
    lines = ["# Run report", "", f"{len(records)} records"]
    if "step" in records[0]:
        lines[-1] += f", {xlabel}s {records[0]['step']} to {records[-1]['step']}"
    syncs = sum(1 for r in records if r.get("sync_event"))
    lines[-1] += f", {syncs} sync events." if any("sync_event" in r for r in records) else "."
    heldout = [(i, r) for i, r in enumerate(records) if isinstance(r.get("heldout_pass1"), int | float)]
    if heldout:
        i, r = heldout[-1]
        p, se = r["heldout_pass1"], _heldout_se(r, r["heldout_pass1"])
        spread = f" ± {se:.3f} (n = {r[HELDOUT_N]:g})" if se is not None else " (n not recorded)"
        lines += ["", f"Last held-out pass@1 at {xlabel.split()[-1]} {_x(records, i):g}: {p:.3f}{spread}."]
    lines += ["", "| metric | first | last |", "|---|---|---|"]
    for key in numeric:
        _, ys = _series(records, key)
        lines.append(f"| {key} | {ys[0]:.4g} | {ys[-1]:.4g} |")
    lines += ["", "## Figures", "", "![overview](report.png)" if panels else "No plottable keys were present.", ""]
    lines += [f"- [{title}]({stem}.png)" for stem, title, _ in panels]
    return "\n".join(lines) + "\n"
