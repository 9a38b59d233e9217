"""The noise study's statistics (benchmarks/paired.py) and its whole pipeline on a tiny model
(`benchmarks/noise_study.py --quick`: task, tuning, paired runs, report; resumable)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import paired  # noqa: E402


def test_the_t_interval_is_the_mean_plus_minus_t_times_the_standard_error():
    mean, low, high = paired.t_interval([0.1, 0.3, 0.2, 0.4, 0.0])
    half = 2.776 * math.sqrt(0.025) / math.sqrt(5)  # sd of the five values is sqrt(0.025)
    assert mean == pytest.approx(0.2)
    assert (low, high) == pytest.approx((0.2 - half, 0.2 + half))
    assert paired.t_interval([0.5])[1:] == (-math.inf, math.inf)  # one seed decides nothing
    with pytest.raises(ValueError, match="no paired differences"):
        paired.t_interval([])


def test_pass_at_k_and_the_zero_advantage_chance_follow_their_counting_formulas():
    assert paired.mean_pass_at_k(16, [0], 4) == 0.0
    assert paired.mean_pass_at_k(16, [1], 1) == pytest.approx(1 / 16)
    assert paired.mean_pass_at_k(16, [13], 4) == 1.0  # fewer than 4 wrong: any 4 hold a right one
    assert paired.mean_pass_at_k(16, [2, 0], 4) == pytest.approx((1 - math.comb(14, 4) / math.comb(16, 4)) / 2)
    assert paired.zero_advantage_chance(16, 0, 8) == 1.0 and paired.zero_advantage_chance(16, 16, 8) == 1.0
    assert paired.zero_advantage_chance(16, 1, 8) == pytest.approx(0.5)  # the right one is left out half the time
    assert paired.zero_advantage_chance(16, 8, 8) == pytest.approx(2 / math.comb(16, 8))


def test_the_bootstrap_keeps_the_pairing_and_finds_a_shift_every_problem_shares():
    base = [[s % 2, (s + 1) % 2, 1, 0, 1, 0, 0, 1] for s in range(5)]
    share = lambda counts: sum(counts) / len(counts)  # noqa: E731
    assert paired.bootstrap_interval(base, base, share, resamples=200) == (0.0, 0.0, 0.0)
    better = [[c + 1 for c in seed] for seed in base]  # one more right answer on every problem
    mean, low, high = paired.bootstrap_interval(better, base, share, resamples=200)
    assert mean == low == high == pytest.approx(1.0)  # paired: the shift is exact in every resample
    noisy = [[c + (i == s) for i, c in enumerate(seed)] for s, seed in enumerate(base)]  # one problem per seed
    mean, low, high = paired.bootstrap_interval(noisy, base, share, resamples=400)
    assert mean == pytest.approx(1 / 8) and low < 1 / 8 < high and low >= 0.0
    with pytest.raises(ValueError, match="the same seeds"):
        paired.bootstrap_interval(base, base[:2], share)


@pytest.mark.slow
@pytest.mark.ray
def test_the_quick_study_runs_every_phase_writes_its_records_and_resumes(tmp_path):
    out = tmp_path / "study"
    command = [sys.executable, os.path.join(BENCHMARKS, "noise_study.py"), "--quick", "--out", str(out)]
    env = {**os.environ, "RAY_ADDRESS": "local"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    read = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines()]  # noqa: E731
    task, tuning, runs = read("task.jsonl"), read("tuning.jsonl"), read("runs.jsonl")
    assert [t["candidate"] for t in task] == ["1:8"] and len(task[0]["sampled"]["correct"]) == 4
    assert [r["arm"] for r in tuning] == ["grpo", "c3po"] and all(r["seed"] == 100 for r in tuning)
    assert sorted((r["arm"], r["seed"]) for r in runs) == [("c3po", 0), ("c3po", 1), ("grpo", 0), ("grpo", 1)]
    for r in runs:  # each run at its arm's tuned step size, evaluated at T and greedy, per problem
        assert r["lr"] == next(t["lr"] for t in tuning if t["arm"] == r["arm"])
        assert len(r["sampled"]["correct"]) == 4 and r["sampled"]["samples"] == 4 and r["greedy"]["samples"] == 1
        assert r["steps"] == 2 and len(r["curves"]["reward_mean"]) == 2 and r["weight_move"] >= 0
        assert r["key"] == {**tuning[0]["key"], "steps": 2, "quick": True}  # reused only at the same settings
    report = (out / "report.md").read_text()
    assert "| c3po − grpo | pass@1 (T) | 2 |" in report and (out / "figure.png").stat().st_size > 0
    again = subprocess.run([*command, "--phase", "task", "tune", "study"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (read("task.jsonl"), read("tuning.jsonl"), read("runs.jsonl")) == (task, tuning, runs)  # nothing re-run
    other = subprocess.run([*command, "--phase", "study", "--steps", "3"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert other.returncode != 0 and "no tuning run" in other.stderr  # other settings: tune them first
