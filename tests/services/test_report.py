"""deploy/report.py on a synthetic metrics.jsonl: PNGs exist and are valid, absent keys are skipped,
report.md summarises first vs last values."""

from __future__ import annotations

import json
import math

import pytest

from threepo.deploy.report import make_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write(run_dir, records):
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def _records(n=40):
    records = []
    for step in range(n):
        # steps 3, 6, 10, 13, ..., 38 sync: 11 events, "budget" on step % 7 == 3
        reason = ("budget" if step % 7 == 3 else "max_staleness") if step % 7 in (3, 6) else None
        records.append({
            "step": step, "time_s": 2.0 * step, "reward_mean": 0.3 + 0.4 * (1 - math.exp(-step / 10)),
            "heldout_pass1": 0.25 + step / 200 if step % 10 == 0 else None,
            "zero_adv_frac": 0.5 * math.exp(-step / 15), "rescued_groups": step % 3,
            "malformed_rate": 0.1 / (1 + step), "staleness_mean": (step % 4) / 2, "staleness_max": step % 4,
            "sync_event": reason is not None, "sync_reason": reason,
            "tokens_per_s/engine0": 900 + 5 * step, "tokens_per_s/engine1": 850 + 3 * step,
        })
    return records


def test_full_report_writes_valid_pngs_and_summary(tmp_path):
    _write(tmp_path, _records())
    paths = make_report(tmp_path)
    names = [p.name for p in paths]
    assert names == ["reward.png", "heldout_pass1.png", "zero_adv_frac.png", "rescued_groups.png",
                     "malformed_rate.png", "staleness.png", "sync_events.png", "tokens_per_s.png", "report.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 5000, path.name
    md = (tmp_path / "report.md").read_text()
    assert "40 records, learner steps 0 to 39, 11 sync events." in md
    assert "| heldout_pass1 | 0.25 | 0.4 |" in md  # first and last of the non-null values
    assert "| tokens_per_s/engine1 | 850 | 967 |" in md
    assert "| sync_event |" not in md  # booleans are not summarised as numbers
    assert "![overview](report.png)" in md and "- [Sync events by reason](sync_events.png)" in md


def test_absent_keys_are_skipped(tmp_path):
    _write(tmp_path, [{"step": s, "reward_mean": s / 10, "staleness_max": 1} for s in range(5)])
    paths = make_report(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "staleness.png", "report.png"]
    assert not (tmp_path / "sync_events.png").exists() and not (tmp_path / "tokens_per_s.png").exists()
    assert (paths[-1].read_bytes()[:8]) == PNG_SIGNATURE
    md = (tmp_path / "report.md").read_text()
    assert "heldout" not in md and "| reward_mean | 0 | 0.4 |" in md


def test_no_plottable_keys_and_bad_input(tmp_path):
    _write(tmp_path, [{"time_s": 1.0}, {"time_s": 2.0}])
    assert make_report(tmp_path) == []
    assert "No plottable keys" in (tmp_path / "report.md").read_text()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1,\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        make_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records to report"):
        make_report(tmp_path)


def _draw(records, stem):
    from threepo.deploy.report import _figure, _panels

    (draw,) = [d for s, _, d in _panels(records) if s == stem]
    ax = _figure(1, 1, 4.0, 3.0).add_subplot()
    draw(ax)
    return ax


def test_smoothing_is_a_centred_moving_average_cut_at_the_ends():
    from threepo.deploy.report import smoothed

    assert smoothed([0.0, 3.0, 6.0, 9.0], 1) == [1.5, 3.0, 6.0, 7.5]
    assert smoothed([1.0, 5.0, 2.0], 0) == [1.0, 5.0, 2.0]
    assert smoothed([2.0, 4.0, 9.0], 5) == [5.0, 5.0, 5.0]


def test_dense_curves_are_smoothed_over_their_faint_raw_values(tmp_path):
    from threepo.deploy.report import smoothed

    records = _records(200)
    ax = _draw(records, "reward")
    raw, smooth = ax.lines
    ys = [r["reward_mean"] for r in records]
    assert list(raw.get_ydata()) == ys and raw.get_alpha() < 0.5
    assert list(smooth.get_ydata()) == pytest.approx(smoothed(ys, 200 // 40))
    assert smooth.get_alpha() in (None, 1.0) and smooth.get_color() == raw.get_color()


def test_heldout_points_carry_their_standard_error_when_n_is_known(tmp_path):
    records = _records(40)
    for r in records:
        if r["heldout_pass1"] is not None and r["step"] >= 20:
            r["heldout_n"] = 256  # older rows (steps 0, 10) have no n: points without bars
    ax = _draw(records, "heldout_pass1")
    (bars,) = ax.containers
    segments = bars.lines[2][0].get_segments()
    for (x, lo), (_, hi) in segments:
        p = 0.25 + x / 200
        se = math.sqrt(p * (1 - p) / 256)
        assert (lo, hi) == pytest.approx((p - se, p + se))
    assert sorted(x for (x, _), _ in segments) == [20, 30]
    plain = [line for line in ax.lines if line not in bars.lines[0:1]]
    assert any(list(line.get_xdata()) == [0, 10] for line in plain)
    _write(tmp_path, records)
    make_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Last held-out pass@1 at step 30: 0.400 ± 0.031 (n = 256)." in md
