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
