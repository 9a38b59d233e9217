"""Ray integration tests of the real driver on CPU: a few steps of every algorithm, a sampler killed
mid-run, and stop/resume. One Ray cluster for the whole session (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from threepo.deploy.cli import make_run_dir
from threepo.deploy.config import load_config
from threepo.deploy.run import train

pytestmark = pytest.mark.ray

SMALL = ["runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.5", "runtime.verifier_cpus=0.25",
         "runtime.prompts_per_step=2", "runtime.steps=3", "runtime.checkpoint_every=0",
         "algo.group_size=8", "sampler.max_new_tokens=12"]


def _cfg(tmp_path, model_path, *overrides):
    return load_config(None, [f"model.path={model_path}", f"runs_dir={tmp_path}", *SMALL, *overrides])


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


ALGORITHMS = {
    "grpo_adamw": ["algo.exploration=grpo", "algo.n_slots=1", "optim.name=adamw", "optim.lr=1e-4"],
    "dr_grpo": ["algo.exploration=grpo", "algo.n_slots=1", "algo.advantage=dr_grpo",
                "algo.loss_agg=seq-mean-token-sum-norm"],
    "b3po": ["algo.exploration=b3po", "algo.n_slots=1"],
    "m3po": ["algo.exploration=m3po", "algo.n_slots=2"],
    "c3po_lampo": ["algo.exploration=c3po", "algo.n_slots=4", "algo.advantage=lampo", "algo.kl_coef=1e-3"],
    "entropy_bonus_temperature": ["algo.exploration=grpo", "algo.n_slots=1", "optim.name=adamw",
                                  "algo.entropy_coef=5e-3", "sampler.temperature=1.3", "algo.eps_high=0.28",
                                  "algo.mini_batches=2"],
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_few_steps_of_each_algorithm(ray_session, tmp_path, tiny_dense_path, name):
    cfg = _cfg(tmp_path, tiny_dense_path, *ALGORITHMS[name])
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_dense_path)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every plan here spends G = 8 rollouts per prompt (equal-compute M3PO: 2 groups of 4)
    assert summary["consumed_rollouts"] == summary["admitted_rollouts"] == 3 * 2 * 8
    assert summary["unique_consumed"] == summary["consumed_rollouts"]
    assert all(r["completion_tokens"] > 0 and r["loss"] == r["loss"] for r in rows)  # finite
    assert os.path.isfile(os.path.join(summary["final_checkpoint"], "model.safetensors"))
    if name in ("b3po", "m3po", "c3po_lampo"):
        assert rows[-1]["sigma_p50"] > 0  # a posterior with noise served the rollouts


def test_killing_a_sampler_mid_run_loses_and_duplicates_nothing(ray_session, tmp_path, tiny_dense_path):
    import ray

    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.steps=8", "runtime.max_offpolicy=2")
    run_dir = make_run_dir(cfg, "train")
    killed = []

    def kill_when_running():
        name = f"{os.path.basename(run_dir)}-sampler-0"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and _metrics(run_dir):
                ray.kill(ray.get_actor(name), no_restart=False)  # Ray restarts it (max_restarts=-1)
                killed.append(name)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    summary = train(cfg, run_dir, tiny_dense_path)
    killer.join()
    assert killed, "the sampler was never killed"
    assert summary["sampler_failures"] >= 1 and summary["reissued_requests"] >= 1
    assert summary["steps"] == 8
    assert summary["admitted_rollouts"] == summary["consumed_rollouts"] == 8 * 2 * 8
    assert summary["unique_consumed"] == summary["consumed_rollouts"]


def test_stop_and_resume_continues_the_same_run(ray_session, tmp_path, tiny_dense_path):
    from threepo.deploy import checkpoints

    det = ["runtime.mode=sync", "runtime.steps=4", "runtime.checkpoint_every=2", "runtime.keep_checkpoints=3"]
    cfg = _cfg(tmp_path / "a", tiny_dense_path, *det)
    full_dir = make_run_dir(cfg, "train")
    train(cfg, full_dir, tiny_dense_path)
    full = _metrics(full_dir)

    cfg_b = _cfg(tmp_path / "b", tiny_dense_path, *det)
    part_dir = make_run_dir(cfg_b, "train")
    train(load_config(os.path.join(part_dir, "config.toml"), ["runtime.steps=2"]), part_dir, tiny_dense_path)
    ckpt = checkpoints.latest(part_dir)
    saved = checkpoints.load(ckpt)
    assert saved["driver"]["step"] == 2 and saved["learner_meta"]["step"] == 2
    assert len(saved["driver"]["consumed_ids"]) == 2 * 2 * 8
    summary = train(cfg_b, part_dir, tiny_dense_path, resume_from=ckpt)
    resumed = _metrics(part_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert summary["unique_consumed"] == summary["consumed_rollouts"] == 4 * 2 * 8
    for a, b in zip(full[2:], resumed[2:]):  # the steps after the resume match the uninterrupted run
        assert a["version"] == b["version"]
        for key in ("reward_mean", "loss", "kl_k3", "completion_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_vp2o_on_the_tiny_moe(ray_session, tmp_path, tiny_moe_path):
    cfg = _cfg(tmp_path, tiny_moe_path, "model.kind=moe", "algo.vp2o=true", "algo.exploration=c3po",
               "vp2o.lift_hi=0.7", "vp2o.lift_lo=0.55")  # top-2 of 4 experts: every lift is below 1
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_moe_path)
    rows = _metrics(run_dir)
    assert summary["consumed_rollouts"] == 3 * 2 * 8
    assert all(0.0 <= r["vp2o_clamped_frac"] <= 1.0 and r["vp2o_bandwidth_mean"] > 0 for r in rows)
    assert all(r["vp2o_l_orth"] >= 0 for r in rows)


def test_rollout_log_holds_every_consumed_group(ray_session, tmp_path, tiny_dense_path):
    from threepo.services.codec import RolloutLog
    from threepo.services.messages import Group

    cfg = _cfg(tmp_path, tiny_dense_path, "runtime.steps=2")
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, tiny_dense_path)
    groups = list(RolloutLog.read(os.path.join(run_dir, "rollouts.log")))
    assert all(isinstance(g, Group) for g in groups) and len(groups) == 2 * 2
    ids = {s.completion.completion_id for g in groups for s in g.completions}
    assert len(ids) == summary["consumed_rollouts"] == 2 * 2 * 8
