"""The transformers sampler engine: the CPU default behind the engine protocol (engines/base.py).

Decoding is our own loop over the model's forward with a KV cache, so that the reported behaviour
log-probs are exactly those of the sampling distribution (temperature, top-k, top-p; see
algorithms/sampling.py) and nothing is hidden in `generate`'s logits processors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from threepo.algorithms import param_noise
from threepo.algorithms.sampling import sample_from_logprobs, sampling_logprobs
from threepo.services.engines.base import GeneratedSample, SamplerConfig
from threepo.services.messages import NoiseSpec, SamplingParams
from threepo.services.modeling import load_model, load_tokenizer, trainable_named_parameters

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 eos_id: int, pad_id: int, generator: torch.Generator | None = None
                 ) -> list[tuple[list[int], list[float], str]]:
    """Sample one completion per prompt. Returns (token ids, behaviour log-probs, finish reason)."""
    lengths = [len(p) for p in prompt_ids]
    width = max(lengths)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):  # left padding keeps every row's last token aligned
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attn[row, width - len(ids):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True)
    cache_kwarg = _cache_kwarg(model)
    tokens, logps = [], []
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    for _ in range(params.max_new_tokens):
        logp = sampling_logprobs(out.logits[:, -1], temperature=params.temperature,
                                 top_k=params.top_k, top_p=params.top_p)
        tok, tok_logp = sample_from_logprobs(logp, generator)
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        logps.append(tok_logp.masked_fill(done, 0.0))
        done = done | (tok == eos_id)
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=positions,
                    **{cache_kwarg: getattr(out, cache_kwarg)}, use_cache=True)
    return _unpad(torch.stack(tokens, 1), torch.stack(logps, 1), eos_id)


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


def generate(model: PreTrainedModel, tokenizer, prompts: Sequence[str], params: SamplingParams, *,
             batch_size: int, generator: torch.Generator | None = None) -> list[list[GeneratedSample]]:
    """`params.n` samples per prompt from `model` as it is now, in batches of `batch_size`."""
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    flat = [ids for ids in encoded for _ in range(params.n)]
    raw = []
    for start in range(0, len(flat), batch_size):
        raw += sample_batch(model, flat[start:start + batch_size], params, eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, generator=generator)
    samples = [
        GeneratedSample(prompt_ids=tuple(ids), token_ids=tuple(toks), logprobs=tuple(lps),
                        finish_reason=finish, text=tokenizer.decode(toks, skip_special_tokens=True))
        for ids, (toks, lps, finish) in zip(flat, raw)
    ]
    return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]


class HFEngine:
    """Serves one policy of a local HF checkpoint on CPU (or one CUDA device) with transformers."""

    def __init__(self, model_path: str, cfg: SamplerConfig, *, engine_id: int = 0, dtype: str = "float32"):
        torch.set_num_threads(cfg.threads)
        torch.set_flush_denormal(True)  # as the learner: denormal softmax tails are slow on CPU
        self.cfg, self.engine_id = cfg, engine_id
        self.model = load_model(model_path, dtype=dtype).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.generator = torch.Generator().manual_seed(param_noise.tensor_seed(cfg.seed, f"engine/{engine_id}"))
        self._params = dict(trainable_named_parameters(self.model))
        self._mean = {n: p.detach().float().clone() for n, p in self._params.items()}
        self._sigma: dict[str, torch.Tensor] | None = None
        self._slots: dict[int | None, tuple[dict[str, torch.Tensor], str]] = {}  # this version's θ̂ by seed
        self.version, self.noise = 0, NoiseSpec(posterior_version=0, seed=None)
        self.checksum = param_noise.weights_checksum(self._mean.items())

    def update_posterior(self, version: int, mean: Mapping[str, np.ndarray],
                         sigma: Mapping[str, np.ndarray] | None) -> None:
        missing = sorted(set(self._params) - set(mean))
        if missing:
            raise KeyError(f"posterior version {version}: mean lacks parameters {missing[:5]}")
        self._mean = {n: torch.from_numpy(np.array(mean[n], dtype=np.float32)) for n in self._params}
        self._sigma = None if sigma is None else {
            n: torch.from_numpy(np.array(sigma[n], dtype=np.float32)) for n in self._params}
        self.version = version
        self._slots.clear()
        self.serve(NoiseSpec(posterior_version=version, seed=None))

    def serve(self, noise: NoiseSpec) -> str:
        if noise.posterior_version != self.version:
            raise ValueError(f"engine {self.engine_id} holds version {self.version}, asked to serve "
                             f"{noise.posterior_version}: update_posterior first")
        if noise.seed is not None and self._sigma is None:
            raise ValueError(f"engine {self.engine_id}: a seeded slot needs σ, but version "
                             f"{self.version} was published without one")
        if noise.seed in self._slots:
            theta, checksum = self._slots[noise.seed]
        else:
            theta = param_noise.perturbed_state(self._mean, self._sigma or {}, noise.seed)
            checksum = param_noise.weights_checksum(theta.items())
            if noise.seed is not None and len(self._slots) < self.cfg.slot_cache:
                self._slots[noise.seed] = (theta, checksum)
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(theta[name])  # in place: never rebind storage, never subtract noise
        self.noise, self.checksum = noise, checksum
        return self.checksum

    def generate(self, prompts: Sequence[str], params: SamplingParams,
                 seed: int | None = None) -> list[list[GeneratedSample]]:
        if seed is not None:  # a call-specific stream: the draw does not depend on earlier calls
            self.generator.manual_seed(param_noise.tensor_seed(seed, f"engine/{self.engine_id}"))
        return generate(self.model, self.tokenizer, prompts, params, batch_size=self.cfg.batch_size,
                        generator=self.generator)

    def close(self) -> None:
        self.model = None
