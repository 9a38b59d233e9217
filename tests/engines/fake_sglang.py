"""A stand-in for `sglang.Engine` as the pinned 0.5.23 behaves (read in its wheel), so that the SGLang
adapter's logic runs the conformance suite where SGLang cannot be installed.

What is faked: the scheduler and sampler (our own decode loop over a transformers model) and SGLang's
output format. What is real: the adapter, the custom weight loaders (run here exactly as SGLang runs
them: `loader(model, named_tensors)` when `load_format` is one of the engine's `custom_weight_loader`
names, else refused), and the model's `load_weights`. Kept from 0.5.23, so that an adapter relying
on other behaviour fails here:
- `update_weights_from_tensor` outside `begin_weight_update()` / `end_weight_update()` is refused;
- an exception in a loader ends the scheduler: the engine is dead and every later call raises;
- a request's `sampling_seed` is used only with `enable_deterministic_inference` (else the engine's own
  stream, which differs from call to call);
- the returned log-prob of a token is log softmax(logits / T), before top-k/top-p truncation;
- there is no pause_generation or continue_generation;
- LoRA (engine started with `enable_lora`): `load_lora_adapter_from_tensors(name, tensors, config_dict)`
  takes PEFT-named tensors and returns an output with `success` and `error_message` (a rank above
  `max_lora_rank`, a name already loaded, more than `max_loaded_loras` adapters: refused, not raised),
  `unload_lora_adapter(name)`, and `generate(..., lora_path=[name or None per request])`; a request's
  adapter is applied as W0 + (α / r) · B A on its layers (SGLang adds the term beside the base matmul).
"""

from __future__ import annotations

import copy
import importlib
from types import SimpleNamespace

import torch

from threepo.services.model.modeling import load_model, load_tokenizer
from threepo.services.sampling.engines.base import EngineRequest
from threepo.services.sampling.engines.decoding import generate
from threepo.services.wire.messages import SamplingParams


class _Model(torch.nn.Module):
    """What SGLang's model offers a loader: named_parameters and load_weights(named tensors)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.hf = load_model(path).eval()

    def load_weights(self, named):
        params = dict(self.hf.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


class FakeSGLangEngine:
    """`sglang.Engine(**server_args)` as the adapter calls it."""

    ACCEPTED = {"model_path", "dtype", "tp_size", "mem_fraction_static", "random_seed", "max_running_requests",
                "context_length", "custom_weight_loader", "enable_deterministic_inference",
                "enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "max_loaded_loras"}

    def __init__(self, **server_args) -> None:
        unknown = set(server_args) - self.ACCEPTED
        assert not unknown, f"server args the fake does not know: {unknown}"
        self.args = server_args
        self.model = _Model(server_args["model_path"])
        self.tokenizer = load_tokenizer(server_args["model_path"])
        self.tokenizer_manager = type("TM", (), {"tokenizer": self.tokenizer})()
        self.flushes, self.session, self.dead, self.draws = 0, False, False, 0
        self.loras: dict[str, torch.nn.Module] = {}  # name -> the model with that adapter applied

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self._alive()
        args = self.args
        refused = ("LoRA is not enabled (start the engine with enable_lora)" if not args.get("enable_lora") else
                   f"adapter {lora_name} is already loaded" if lora_name in self.loras else
                   f"rank {config_dict['r']} > max_lora_rank {args['max_lora_rank']}"
                   if config_dict["r"] > args["max_lora_rank"] else
                   f"max_loaded_loras {args['max_loaded_loras']} reached" if len(self.loras) >= args["max_loaded_loras"]
                   else None)
        if refused:
            return SimpleNamespace(success=False, error_message=refused, loaded_adapters=None)
        model = copy.deepcopy(self.model.hf)
        params, scaling = dict(model.named_parameters()), config_dict["lora_alpha"] / config_dict["r"]
        with torch.no_grad():
            for name, a in tensors.items():
                if ".lora_A." in name:
                    layer = name.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
                    params[layer].add_(tensors[name.replace(".lora_A.", ".lora_B.")] @ a, alpha=scaling)
        self.loras[lora_name] = model.eval()
        return SimpleNamespace(success=True, error_message=None, loaded_adapters=list(self.loras))

    def unload_lora_adapter(self, lora_name):
        self._alive()
        if self.loras.pop(lora_name, None) is None:
            return SimpleNamespace(success=False, error_message=f"adapter {lora_name} is not loaded", loaded_adapters=None)
        return SimpleNamespace(success=True, error_message=None, loaded_adapters=list(self.loras))

    def _alive(self):
        if self.dead:
            raise RuntimeError("the SGLang scheduler exited (an exception in its event loop)")

    def begin_weight_update(self, selector="all"):
        self._alive()
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self._alive()
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive()
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if load_format not in self.args["custom_weight_loader"]:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        module, _, fn = load_format.rpartition(".")
        try:
            getattr(importlib.import_module(module), fn)(self.model, [(n, t.clone()) for n, t in named_tensors])
        except Exception:
            self.dead = True  # 0.5.23: the scheduler process ends, the engine's process is signalled
            raise
        self.flushes += bool(flush_cache)
        return True, "Success"

    def generate(self, input_ids, sampling_params, return_logprob=False, lora_path=None):
        self._alive()
        assert return_logprob and len(input_ids) == len(sampling_params)
        lora_path = lora_path or [None] * len(input_ids)
        assert len(lora_path) == len(input_ids) and all(n is None or n in self.loras for n in lora_path), lora_path
        deterministic = self.args.get("enable_deterministic_inference", False)
        out = []
        for ids, sp, adapter in zip(input_ids, sampling_params, lora_path):
            model = self.model.hf if adapter is None else self.loras[adapter]
            self.draws += 1
            seed = sp.get("sampling_seed") if deterministic and sp.get("sampling_seed") is not None else (
                (self.args.get("random_seed") or 0) * 1_000_003 + self.draws)
            params = SamplingParams(temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                                    top_k=max(0, sp.get("top_k", -1)), max_new_tokens=sp["max_new_tokens"],
                                    stop_token_ids=tuple(sp["stop_token_ids"]))
            s = generate(model, self.tokenizer, [EngineRequest(tuple(ids), 1, seed)], params, batch_size=1)[0][0]
            logprobs = self._untruncated(model, ids, s.token_ids, params.temperature)
            out.append({"text": s.text, "output_ids": list(s.token_ids), "meta_info": {
                "finish_reason": {"type": "stop" if s.finish_reason == "stop" else "length"},
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, s.token_ids)]}})
        return out

    @torch.no_grad()
    def _untruncated(self, model, prompt_ids, token_ids, temperature: float) -> list[float]:
        """0.5.23's reported log-probs: log softmax(logits / T) of each sampled token, no truncation."""
        ids = torch.tensor([list(prompt_ids) + list(token_ids)])
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # greedy: the logits themselves
        return logp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).tolist()

    def flush_cache(self):
        self.flushes += 1

    def shutdown(self):
        self.model = None
