"""A short bootstrap learns the task above chance and is cached; `threepo eval` prints its figures."""

from __future__ import annotations

import json
import os

import pytest

from threepo.services.bootstrap import BootstrapConfig, ensure_bootstrapped, heldout_pass1
from threepo.services.modeling import ModelConfig, load_model, load_tokenizer
from threepo.services.tasks import TaskConfig


@pytest.mark.slow
def test_a_short_bootstrap_learns_above_chance_and_is_cached(tmp_path):
    model_cfg = ModelConfig(hidden_size=64, intermediate_size=256)
    task = TaskConfig(difficulty=1)  # 0-99 with + and -: answers in [0, 198], so chance is < 0.01
    cfg = BootstrapConfig(max_seconds=90, target_pass1=0.1, eval_every=100, eval_items=128,
                          threads=1, cache_dir=str(tmp_path))  # one thread: robust on a busy machine
    result = ensure_bootstrapped(model_cfg, task, cfg, progress=False)
    model, tok = load_model(result.path), load_tokenizer(result.path)  # a loadable HF checkpoint
    measured = heldout_pass1(model, tok, task, 256)
    assert measured > 0.03, f"pass@1 {measured:.3f} after {result.steps} steps is not above chance"
    if result.reached_target:
        again = ensure_bootstrapped(model_cfg, task, cfg, progress=False)
        assert again.cached and again.path == result.path
        assert os.path.isfile(os.path.join(result.path, "model.safetensors"))


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
