"""Code RL end to end on local Ray: `threepo train` on a HumanEval-shaped file (`data.format=humaneval`,
as the benchmark ships) with the embedded tiny model, the `code_tests` verifier running every rollout
under its test harness in the bubblewrap sandbox; records exact, every status a real verdict."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from threepo.deploy.commands import make_run_dir
from threepo.deploy.config import load_config
from threepo.deploy.run import train
from threepo.services.wire.batching import logged_groups
from threepo.services.wire.messages import VerifyStatus

pytestmark = [pytest.mark.ray, pytest.mark.skipif(shutil.which("bwrap") is None,
                                                  reason="bubblewrap missing: apt-get install -y bubblewrap")]


def _problem(i: int) -> dict:
    name = f"add_{i}"
    return {"task_id": f"Tiny/{i}", "prompt": f'def {name}(a, b):\n    """Return a + b + {i}."""\n',
            "canonical_solution": f"    return a + b + {i}\n", "entry_point": name,
            "test": f"def check(candidate):\n    assert candidate(1, 2) == {3 + i}\n    assert candidate(0, 0) == {i}\n"}


def test_code_rl_on_a_humaneval_shaped_file(ray_session, tmp_path, tiny_dense_path):
    data = tmp_path / "humaneval_like.jsonl"
    data.write_text("".join(json.dumps(_problem(i)) + "\n" for i in range(12)))
    cfg = load_config(None, [f"model.path={tiny_dense_path}", f"runs_dir={tmp_path}", f"data.path={data}",
                             "data.format=humaneval", "data.heldout_fraction=0", "runtime.steps=2",
                             "runtime.prompts_per_step=2", "algo.group_size=4", "algo.exploration=none",
                             "algo.n_slots=1", "sampler.max_new_tokens=12", "runtime.checkpoint_every=end",
                             "runtime.eval_every=off", "runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.5",
                             "runtime.verifier_cpus=0.25"])
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_dense_path)
    assert summary["steps"] == 2 and summary["admitted_rollouts"] == summary["consumed_rollouts"] == 16
    groups = list(logged_groups(os.path.join(run_dir, "rollouts.log")))
    results = [s.result for g in groups for s in g.completions]
    assert all(g.item.verifier == "code_tests" and g.item.code_prefix.startswith("def add_") for g in groups)
    assert len(results) == 16 and not any(r.status is VerifyStatus.INFRA_ERROR for r in results)
    # a random model's 12 characters, joined to the prompt as a body: scored by running them, not ok
    assert {r.status for r in results} <= {VerifyStatus.COMPILE_ERROR, VerifyStatus.RUNTIME_ERROR,
                                           VerifyStatus.WRONG, VerifyStatus.MALFORMED}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if "reward_mean" in line]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_mean"] == 0.0 for r in rows)
