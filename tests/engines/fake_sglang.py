"""A stand-in for `sglang.Engine` with the documented call signatures (0.5.23, feasibility.md), so
that the SGLang adapter's logic runs the conformance suite where SGLang cannot be installed.

What is faked: the scheduler and sampler (our own decode loop over a transformers model, with the
request's `sampling_seed`) and SGLang's output format. What is real: the adapter, the custom weight
loaders (run here exactly as SGLang runs them: `loader(model, named_tensors)` when `load_format` is
one of the engine's `custom_weight_loader` names, else refused), and the model's `load_weights`.
"""

from __future__ import annotations

import importlib

import torch

from threepo.services.engines.base import EngineRequest
from threepo.services.engines.decoding import generate
from threepo.services.messages import SamplingParams
from threepo.services.modeling import load_model, load_tokenizer


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
                "context_length", "custom_weight_loader"}

    def __init__(self, **server_args) -> None:
        unknown = set(server_args) - self.ACCEPTED
        assert not unknown, f"server args the fake does not know: {unknown}"
        self.args = server_args
        self.model = _Model(server_args["model_path"])
        self.tokenizer = load_tokenizer(server_args["model_path"])
        self.tokenizer_manager = type("TM", (), {"tokenizer": self.tokenizer})()
        self.paused, self.flushes = False, 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if load_format not in self.args["custom_weight_loader"]:
            return False, f"Unknown load_format={load_format}"
        module, _, fn = load_format.rpartition(".")
        try:
            getattr(importlib.import_module(module), fn)(self.model, [(n, t.clone()) for n, t in named_tensors])
        except RuntimeError as err:
            return False, str(err)
        self.flushes += bool(flush_cache)
        return True, "Success"

    def generate(self, input_ids, sampling_params, return_logprob=False):
        assert return_logprob and len(input_ids) == len(sampling_params)
        out = []
        for ids, sp in zip(input_ids, sampling_params):
            params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"],
                                    top_k=max(0, sp["top_k"]), max_new_tokens=sp["max_new_tokens"],
                                    stop_token_ids=tuple(sp["stop_token_ids"]))
            s = generate(self.model.hf, self.tokenizer, [EngineRequest(tuple(ids), 1, sp["sampling_seed"])],
                         params, batch_size=1)[0][0]
            out.append({"text": s.text, "output_ids": list(s.token_ids), "meta_info": {
                "finish_reason": {"type": "stop" if s.finish_reason == "stop" else "length"},
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(s.logprobs, s.token_ids)]}})
        return out

    def pause_generation(self):
        self.paused = True

    def continue_generation(self):
        self.paused = False

    def flush_cache(self):
        self.flushes += 1

    def shutdown(self):
        self.model = None
