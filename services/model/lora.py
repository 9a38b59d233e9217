"""LoRA adapters on the learner's model (`[lora]`), through the `peft` library: the base weights frozen,
each target linear layer W given a trainable low-rank term, W x + (α / r) · B A x (Hu et al. 2021,
"LoRA", eq. 3; A [r, in] random, B [out, r] zero at the start, so training starts at the base model).

`attach` puts adapters into a loaded transformers model in place (`peft.inject_adapter_in_model`: the
model keeps its class and its `base_model`, so every forward of services/model/prefix_forward.py runs
unchanged) and freezes everything else; its trainable parameters are then the adapters alone.
`merged_weights` is the model with each adapter folded in, W + (α / r) · B A, under the model's own
parameter names: what the learner exports (and publishes where versions are not adapter-sized).
`save_adapter` / `write_adapter` write adapters as a PEFT adapter directory (`adapter_config.json`,
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read (the
vLLM engine stages each slot this way; `peft_tensors` and `peft_config_dict` are the same adapter for
SGLang's load-from-tensors); services/model/modeling.py `adapter_checkpoint` turns such a directory back
into a full checkpoint, which is how `model.path` accepts one.

Not here: which optimizer trains the adapters (services/learner/optimizers.py). Importing this module
imports neither torch nor peft (the configuration reads `LoRAConfig` and `check_lora`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from threepo.services.learner.config import AlgoConfig, LearnerConfig

_ADAPTER = "default"  # peft's name for the one adapter
_PEFT_PREFIX = "base_model.model."  # how a PeftModel names what it wraps, in the adapter file


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA on the learner's model (`[lora]`); rank 0 trains every weight."""

    rank: int = 0
    """r of every adapter (0: no adapters, full fine-tuning)."""
    alpha: float = 16.0
    """α: the adapter term is scaled by α / r."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear layers given adapters (the last part of a module's name; the default:
    every attention and MLP projection of Qwen2, Llama and Mistral decoders). No dropout: a
    rollout's log-probabilities must be the same at every forward."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank: expected >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha: expected > 0, got {self.alpha}")
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules: expected at least one module name")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


def check_lora(lora: LoRAConfig, algo: AlgoConfig, learner: LearnerConfig) -> None:
    """Reject what LoRA training (`lora.rank` > 0, services/model/lora.py) does not do yet, naming the keys to change."""
    if not lora.rank:
        return
    for bad, fix in ((learner.deepspeed_stage >= 0, "learner.deepspeed_stage=-1"), (learner.ranks > 1, "learner.ranks=1"),
                     (algo.vp2o, "algo.vp2o=false")):
        if bad:
            raise ValueError(f"lora.rank={lora.rank} trains on one learner rank without DeepSpeed or VP2O: set {fix}")


def _peft_config(cfg: LoRAConfig, base_path: str = ""):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules), lora_dropout=0.0,
                      base_model_name_or_path=base_path or None)


def attach(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """Adapters of `cfg` in `model`, in place; every other parameter frozen. A target that names no
    module of the model is one clear error, not a silent full-model run."""
    from peft import inject_adapter_in_model

    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in leaves]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} name no module of this {type(model).__name__}; "
                         f"its linear layers include {sorted(_linear_leaves(model))}")
    return inject_adapter_in_model(_peft_config(cfg), model, adapter_name=_ADAPTER)


def _linear_leaves(model: torch.nn.Module) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name}


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """`model` as its base for the duration: every adapter's term left out (peft's `enable_adapters`),
    then put back, trainable again. The KL penalty's reference policy is this, not a second copy."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: W + (α / r) · B A for an adapted layer's weight, else the parameter}, detached, under
    the names the model has without adapters (tied weights once, as `named_parameters` gives them)."""
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        return _merged(model, LoraLayer)


def _merged(model, LoraLayer) -> dict:
    deltas = {f"{name}.base_layer.weight": m.get_delta_weight(_ADAPTER) for name, m in model.named_modules()
              if isinstance(m, LoraLayer)}
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = p.detach() + deltas[name] if name in deltas else p.detach()
    return out


def save_adapter(model: torch.nn.Module, cfg: LoRAConfig, directory: str, base_path: str) -> str:
    """The adapters as a PEFT adapter directory on the base model at `base_path`."""
    return write_adapter({n: p for n, p in model.named_parameters() if ".lora_" in n}, cfg, directory, base_path)


def write_adapter(tensors: dict, cfg: LoRAConfig, directory: str, base_path: str) -> str:
    """`tensors` (lora_A/lora_B weights under the learner's names, `<layer>.lora_A.default.weight`) as
    a PEFT adapter directory on the base model at `base_path`: what `peft.PeftModel.from_pretrained`
    and vLLM's LoRA loader read (names `base_model.model.<layer>.lora_A.weight`)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(peft_tensors(tensors), os.path.join(directory, "adapter_model.safetensors"))
    _peft_config(cfg, os.path.abspath(base_path)).save_pretrained(directory)
    return directory


def peft_tensors(tensors: dict) -> dict:
    """The learner's adapter tensors under PEFT's names (fp32, contiguous), as an adapter file holds them."""
    return {_PEFT_PREFIX + n.replace(f".{_ADAPTER}.", "."): t.detach().float().contiguous() for n, t in tensors.items()}


def peft_config_dict(cfg: LoRAConfig) -> dict:
    """The `adapter_config.json` of adapters of `cfg` (the config `write_adapter` saves), as a dict of
    plain values (SGLang's load-from-tensors takes it)."""
    config = _peft_config(cfg).to_dict()
    return {**config, "peft_type": config["peft_type"].value, "target_modules": sorted(config["target_modules"])}


def adapter_config(tensors: dict, rank: int, alpha: float) -> LoRAConfig:
    """The `LoRAConfig` of a version's adapter tensors (learner names): its target modules from the names."""
    targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    return LoRAConfig(rank=rank, alpha=alpha, target_modules=tuple(targets))
