"""The transformers sampler engine: the CPU default behind the engine protocol (engines/base.py).

Decoding is our own loop over the model's forward with a KV cache, so that the reported behaviour
log-probs are exactly those of the sampling distribution (temperature, top-k, top-p; see
algorithms/sampling.py) and nothing is hidden in `generate`'s logits processors. Each sampled row
draws from the counter stream of its own request seed, so a request reproduces exactly whatever
else is in the batch. Weights are served in place: the parameters' storage never changes, so the
fingerprint check reads exactly what the forward pass uses.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from threepo.algorithms import param_noise
from threepo.algorithms.sampling import row_uniforms, sample_with_uniforms, sampling_logprobs
from threepo.services.engines.qwen2_decode import LeanQwen2
from threepo.services.engines.base import (EngineRequest, GeneratedSample, SamplerConfig, ServeReport,
                                           WeightsMismatch)
from threepo.services.messages import NoiseSpec, SamplingParams
from threepo.services.modeling import load_model, load_tokenizer, trainable_named_parameters

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingParams, *, eos_id: int, pad_id: int) -> list[tuple[list[int], list[float], str]]:
    """Sample one completion per prompt, row b drawing from the counter stream of `seeds[b]`.
    Returns (token ids, behaviour log-probs, finish reason) per row."""
    lengths = [len(p) for p in prompt_ids]
    width = max(lengths)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):  # left padding keeps every row's last token aligned
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attn[row, width - len(ids):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    step_logits = _stepper(model, input_ids, attn, positions, params.max_new_tokens)
    row_seeds = np.array(seeds, dtype=np.uint64)
    tokens, logps = [], []
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    logits = step_logits(None)
    for step in range(params.max_new_tokens):
        logp = sampling_logprobs(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        tok, tok_logp = sample_with_uniforms(logp, row_uniforms(row_seeds, step))
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        logps.append(tok_logp.float().masked_fill(done, 0.0))
        done = done | (tok == eos_id)
        if bool(done.all()) or step + 1 == params.max_new_tokens:
            break
        logits = step_logits(tok)
    return _unpad(torch.stack(tokens, 1), torch.stack(logps, 1), eos_id)


def _stepper(model: PreTrainedModel, input_ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor,
             max_new_tokens: int):
    """A function giving the next-token logits [B, V]: of the prompt (called with None), then after
    each sampled token. Dense Qwen2 models take the lean decoder (engines/qwen2_decode.py), others
    transformers' forward with its KV cache."""
    width = input_ids.shape[1]
    if LeanQwen2.supports(model):
        lean = LeanQwen2(model)
        cache = lean.new_cache(len(input_ids), width + max_new_tokens, model.dtype)
        keys = torch.zeros((len(input_ids), width + max_new_tokens), dtype=torch.bool)
        keys[:, :width] = attn.bool()
        at = {"len": 0, "pos": positions[:, -1:]}

        def lean_step(tok):
            if tok is None:
                at["len"] = width
                return lean.forward(input_ids, positions, cache, 0, keys)
            keys[:, at["len"]] = True
            at["pos"] = at["pos"] + 1
            logits = lean.forward(tok[:, None], at["pos"], cache, at["len"], keys)
            at["len"] += 1
            return logits
        return lean_step
    state = {"attn": attn, "pos": positions, "out": None}
    cache_kwarg = _cache_kwarg(model)

    def hf_step(tok):
        if tok is None:
            state["out"] = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True)
        else:
            state["attn"] = torch.cat([state["attn"], torch.ones_like(state["attn"][:, :1])], dim=1)
            state["pos"] = state["pos"][:, -1:] + 1
            state["out"] = model(input_ids=tok[:, None], attention_mask=state["attn"], position_ids=state["pos"],
                                 **{cache_kwarg: getattr(state["out"], cache_kwarg)}, use_cache=True)
        return state["out"].logits[:, -1]
    return hf_step


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x); vLLM pins older ones."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _unpad(tokens: torch.Tensor, logps: torch.Tensor, eos_id: int) -> list[tuple[list[int], list[float], str]]:
    results = []
    for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist()):
        if eos_id in row_tokens:
            end = row_tokens.index(eos_id) + 1
            results.append((row_tokens[:end], row_logps[:end], "stop"))
        else:
            results.append((row_tokens, row_logps, "length"))
    return results


def generate(model: PreTrainedModel, tokenizer, requests: Sequence[EngineRequest], params: SamplingParams, *,
             batch_size: int) -> list[list[GeneratedSample]]:
    """`r.n` samples per request from `model` as it is now, in batches of `batch_size` rows."""
    flat = [(r.prompt_ids, r.seed + j) for r in requests for j in range(r.n)]
    raw = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start:start + batch_size]
        raw += sample_batch(model, [p for p, _ in chunk], [s for _, s in chunk], params,
                            eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    samples = [GeneratedSample(token_ids=tuple(toks), logprobs=tuple(lps), finish_reason=finish,
                               text=tokenizer.decode(toks, skip_special_tokens=True))
               for toks, lps, finish in raw]
    out, at = [], 0
    for r in requests:
        out.append(samples[at:at + r.n])
        at += r.n
    return out


def prompt_requests(tokenizer, prompts: Sequence[str], n: int, seed: int = 0) -> list[EngineRequest]:
    """Engine requests for plain-text prompts (evaluation, tests); prompt i of the call draws from
    its own stream, hashed from (seed, i, prompt)."""
    return [EngineRequest(tuple(tokenizer(p, add_special_tokens=False)["input_ids"]), n,
                          param_noise.tensor_seed(seed, f"{i}/{p}")) for i, p in enumerate(prompts)]


def generate_text(model: PreTrainedModel, tokenizer, prompts: Sequence[str], params: SamplingParams, *,
                  batch_size: int, seed: int = 0) -> list[list[GeneratedSample]]:
    """`params.n` samples per plain-text prompt (the `GenerateFn` of services/evaluation.py)."""
    return generate(model, tokenizer, prompt_requests(tokenizer, prompts, params.n, seed), params,
                    batch_size=batch_size)


class HFEngine:
    """Serves one policy of a local HF checkpoint on CPU (or one CUDA device) with transformers."""

    def __init__(self, model_path: str, cfg: SamplerConfig, *, engine_id: int = 0, dtype: str = "float32"):
        torch.set_num_threads(cfg.threads)
        torch.set_flush_denormal(True)  # as the learner: denormal softmax tails are slow on CPU
        self.cfg, self.engine_id = cfg, engine_id
        self.dtype = getattr(torch, dtype if cfg.dtype == "auto" else cfg.dtype)
        self.model = load_model(model_path, dtype=str(self.dtype).removeprefix("torch.")).eval()
        self.tokenizer = load_tokenizer(model_path)
        self._params = dict(trainable_named_parameters(self.model))
        self._mean = {n: p.detach().float().clone() for n, p in self._params.items()}
        self._sigma: dict[str, torch.Tensor] | None = None
        self._slots: dict[tuple, tuple[dict[str, torch.Tensor], float]] = {}  # (seed, scale) -> served θ̂, noise ratio
        self.version, self.mean_checksum = 0, param_noise.weights_checksum(self._mean.items())
        self.paused = False
        self.report = self.serve(NoiseSpec(posterior_version=0, seed=None))

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str) -> None:
        missing = sorted(set(self._params) - set(mean))
        if missing:
            raise WeightsMismatch(f"posterior version {version}: mean lacks parameters {missing[:5]}")
        held = {n: torch.from_numpy(np.array(mean[n], dtype=np.float32)) for n in self._params}
        received = param_noise.weights_checksum(held.items())
        if received != mean_checksum:
            raise WeightsMismatch(f"engine {self.engine_id}: the mean of version {version} has checksum "
                                  f"{received}, the learner published {mean_checksum}")
        self._mean, self.version, self.mean_checksum = held, version, received
        self._sigma = None if sigma is None else {
            n: torch.from_numpy(np.array(sigma[n], dtype=np.float32)) for n in self._params}
        self._slots.clear()
        self.serve(NoiseSpec(posterior_version=version, seed=None))

    def serve(self, noise: NoiseSpec) -> ServeReport:
        if noise.posterior_version != self.version:
            raise ValueError(f"engine {self.engine_id} holds version {self.version}, asked to serve "
                             f"{noise.posterior_version}: load_version first")
        if noise.seed is not None and self._sigma is None:
            raise ValueError(f"engine {self.engine_id}: a seeded slot needs σ, but version "
                             f"{self.version} was published without one")
        key = (noise.seed, noise.scale)
        if key in self._slots:
            served, ratio = self._slots[key]
        else:
            theta = param_noise.perturbed_state(self._mean, self._sigma or {}, noise.seed, noise.scale)
            served = {n: t.to(self.dtype) for n, t in theta.items()}
            parts = [param_noise.served_noise_ratio(self._mean[n], theta[n], self.dtype) for n in theta]
            intended = sum(b for _, b in parts)
            ratio = (sum(a for a, _ in parts) / intended) ** 0.5 if intended else 1.0
            if noise.seed is not None and len(self._slots) < self.cfg.slot_cache:
                self._slots[key] = (served, ratio)
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(served[name])  # in place: never rebind storage, never subtract noise
        self._fingerprint = param_noise.value_fingerprint(served.values())
        loaded_ok = self.verify()
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum, loaded_ok, ratio, scale=noise.scale)
        return self.report

    def encode(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        if self.paused:
            raise RuntimeError(f"engine {self.engine_id} is paused: resume() before generate")
        return generate(self.model, self.tokenizer, requests, params, batch_size=self.cfg.batch_size)

    def verify(self) -> bool:
        return param_noise.value_fingerprint(self._params.values()) == self._fingerprint

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.model = None
