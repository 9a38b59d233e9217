"""benchmarks/gpu_check.py's CPU self-check (`--dry-run`): the GPU tier with the CPU as its target and
every measurement on a tiny model, in one process without Ray, writing the report a GPU run writes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_device_check_dry_run_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"] and set(report["parts"]) == {"tier", "noise", "engine", "learner"}
    assert "4 passed" in report["parts"]["tier"]["summary"]  # the tier ran, not skipped
    assert report["parts"]["noise"]["slot_loaded_ok"] and report["parts"]["noise"]["z_params_per_s"] > 0
    assert report["parts"]["engine"]["one_slot_tokens_per_s"] > 0 and report["parts"]["learner"]["c3po"]["step_s"] > 0


def test_without_a_gpu_the_check_says_so_in_one_line():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "Traceback" not in done.stderr
