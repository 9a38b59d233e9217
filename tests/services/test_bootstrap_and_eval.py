"""A short bootstrap learns the task above chance and is cached; `threepo eval` prints its figures."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from threepo.services.bootstrap import BootstrapConfig, ensure_bootstrapped, heldout_pass1
from threepo.services.model.modeling import ModelConfig, load_model, load_tokenizer
from threepo.services.tasks.synthetic import TaskConfig


@pytest.mark.slow
def test_a_short_bootstrap_learns_above_chance_and_is_cached(tmp_path):
    model_cfg = ModelConfig(hidden_size=64, intermediate_size=256)
    task = TaskConfig(difficulty=1)  # 0-99 with + and -: answers in [0, 198], so chance is < 0.01
    cfg = BootstrapConfig(max_steps=600, target_pass1=0.1, eval_every=100, eval_items=128,
                          threads=1, cache_dir=str(tmp_path))
    result = ensure_bootstrapped(model_cfg, task, cfg, progress=False)
    model, tok = load_model(result.path), load_tokenizer(result.path)  # a loadable HF checkpoint
    measured = heldout_pass1(model, tok, task, 256)
    assert measured > 0.03, f"pass@1 {measured:.3f} after {result.steps} steps is not above chance"
    if result.reached_target:
        again = ensure_bootstrapped(model_cfg, task, cfg, progress=False)
        assert again.cached and again.path == result.path
        assert os.path.isfile(os.path.join(result.path, "model.safetensors"))


TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _tiny_bootstrap(cache_dir, **kw):
    cfg = BootstrapConfig(**{**dict(max_steps=8, eval_every=4, eval_items=48, batch_size=32, warmup_steps=4,
                                    target_pass1=0.9, threads=1, cache_dir=str(cache_dir)), **kw})
    result = ensure_bootstrapped(TINY, TaskConfig(difficulty=1), cfg, progress=False)
    with open(os.path.join(result.path, "model.safetensors"), "rb") as f:
        return result, cfg, hashlib.sha256(f.read()).hexdigest()


def test_bootstrap_is_bounded_by_steps_and_the_same_under_a_cpu_hog(tmp_path):
    quiet, cfg, quiet_sum = _tiny_bootstrap(tmp_path / "quiet")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        busy, _, busy_sum = _tiny_bootstrap(tmp_path / "busy")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert (busy.steps, busy.heldout_pass1, busy_sum) == (quiet.steps, quiet.heldout_pass1, quiet_sum)
    # the target (0.9) is out of reach in 8 steps: the step budget ends it, the same everywhere
    assert quiet.steps == 8 and quiet.stopped_by == "max_steps" and not quiet.reached_target
    assert "bootstrap.max_steps=8" in quiet.failure(cfg) and "on every machine" in quiet.failure(cfg)
    assert not os.path.exists(os.path.join(tmp_path / "quiet", "models"))  # a miss is never cached


def test_the_wall_clock_safety_net_says_what_happened(tmp_path):
    result, cfg, _ = _tiny_bootstrap(tmp_path, max_seconds=1e-9)
    assert result.stopped_by == "max_seconds" and result.steps == 1 and not result.reached_target
    assert "wall-clock safety net" in result.failure(cfg) and "bootstrap.max_seconds" in result.failure(cfg)


def test_a_missed_bootstrap_target_is_one_line_and_leaves_no_run_directory(tmp_path):
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "threepo.deploy.cli", "train", f"runs_dir={runs}",
         f"bootstrap.cache_dir={tmp_path}", "bootstrap.max_steps=2", "bootstrap.eval_items=8",
         "bootstrap.batch_size=8", "bootstrap.threads=1", "model.hidden_size=32", "model.num_layers=1",
         "model.intermediate_size=64"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert last.startswith("threepo train: bootstrap used its whole step budget (bootstrap.max_steps=2)")
    assert not runs.exists() or not list(runs.iterdir())


def test_eval_command_prints_pass_at_k_and_malformed_rate(tmp_path, tiny_dense_path, capsys):
    from threepo.deploy.cli import main

    code = main(["eval", f"model.path={tiny_dense_path}", f"runs_dir={tmp_path}", "eval.num_items=8",
                 "eval.samples_per_item=4", "eval.k=2", "sampler.max_new_tokens=8"])
    out = capsys.readouterr().out
    assert code == 0 and "pass@1" in out and "pass@2" in out and "malformed" in out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("threepo-eval-")]
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["num_items"] == 8 and report["malformed_rate"] > 0.9  # an untrained model rarely boxes
    assert (run_dir / "config.toml").read_text().count("[eval]") == 1
    assert main(["eval", "eval.k=9"]) == 2  # k > samples_per_item: a config error, exit code 2
