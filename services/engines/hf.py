"""The transformers sampler engine: the CPU default behind the engine protocol (engines/base.py).

Decoding is our own loop over the model's forward with a KV cache, so that the reported behaviour
log-probs are exactly those of the sampling distribution (temperature, top-k, top-p; see
algorithms/sampling.py) and nothing is hidden in `generate`'s logits processors. Each sampled row
draws from the counter stream of its own request seed, so a request reproduces exactly whatever
else is in the batch. Weights are served in place: the parameters' storage never changes, so the
fingerprint check reads exactly what the forward pass uses. `generate_slots` samples several slots
in shared forward passes instead (dense Qwen2): the lean decoder stacks the slots' θ̂ and decodes each
row under its own slot, and its weight check fingerprints each slot's stacked tensors. On the lean
decoder a prompt repeated under one slot (a request's n samples) is prefilled once, and its keys,
values and logits are copied to each of its rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
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


_DECODERS_KEPT = 4  # multi-slot lean decoders an engine keeps per version (a C3PO call's slot sets recur)


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingParams, *, eos_id: int, pad_id: int,
                 lean: LeanQwen2 | None = None) -> list[tuple[list[int], list[float], str]]:
    """Sample one completion per prompt, row b drawing from the counter stream of `seeds[b]`.
    Returns (token ids, behaviour log-probs, finish reason) per row. `lean`: decode with this lean
    decoder (its S weight slots take S equal consecutive groups of rows) instead of the model."""
    lengths = [len(p) for p in prompt_ids]
    width = max(lengths)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):  # left padding keeps every row's last token aligned
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attn[row, width - len(ids):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    step_logits = _stepper(model, input_ids, attn, positions, params.max_new_tokens, lean)
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
             max_new_tokens: int, lean: LeanQwen2 | None = None):
    """A function giving the next-token logits [B, V]: of the prompt (called with None), then after
    each sampled token. Dense Qwen2 models take the lean decoder (engines/qwen2_decode.py; `lean`
    if given), others transformers' forward with its KV cache."""
    width = input_ids.shape[1]
    if lean is not None or LeanQwen2.supports(model):
        lean = lean or LeanQwen2(model)
        cache = lean.new_cache(len(input_ids), width + max_new_tokens, model.dtype)
        keys = torch.zeros((len(input_ids), width + max_new_tokens), dtype=torch.bool)
        keys[:, :width] = attn.bool()
        at = {"len": 0, "pos": positions[:, -1:]}

        def lean_step(tok):
            if tok is None:
                at["len"] = width
                return _shared_prefill(lean, input_ids, positions, cache, keys)
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


def _shared_prefill(lean: LeanQwen2, input_ids: torch.Tensor, positions: torch.Tensor, cache: list,
                    keys: torch.Tensor) -> torch.Tensor:
    """The prompt's logits [B, V], its keys and values written into `cache`, with each distinct
    (prompt, weight slot) computed once: rows that repeat a prompt under the same slot (a request's
    n samples) take its keys, values and logits. Per row it is the same computation as the whole
    batch's prefill, so it equals it to fp32 rounding (the matmuls' blocking depends on the rows)."""
    width = input_ids.shape[1]
    shared = _distinct_rows(torch.cat([input_ids, keys[:, :width]], 1), lean.n_slots)
    if shared is None:
        return lean.forward(input_ids, positions, cache, 0, keys)
    first, inverse = shared
    small = lean.new_cache(len(first), width, cache[0][0].dtype)
    logits = lean.forward(input_ids[first], positions[first], small, 0, keys[first])
    for (k, v), (k_small, v_small) in zip(cache, small):
        k[:, :, :width], v[:, :, :width] = k_small[inverse], v_small[inverse]
    return logits[inverse]


def _distinct_rows(rows: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For `rows` [B, W] in `slots` equal consecutive blocks (one per weight slot): the first row of
    each distinct row of each block, U per block (U the most distinct rows of any block; a block with
    fewer repeats its first), and each row's index among those S·U; None if no block repeats a row."""
    b = len(rows) // slots
    blocks = [torch.unique(rows[s * b:(s + 1) * b], dim=0, return_inverse=True)[1] for s in range(slots)]
    distinct = max(int(inv.max()) + 1 for inv in blocks)
    if distinct == b:
        return None
    first, inverse = [], []
    for s, inv in enumerate(blocks):
        at = torch.full((distinct,), b, dtype=torch.long).scatter_reduce_(0, inv, torch.arange(b), "amin")
        at[at == b] = at[0]  # this block has fewer distinct rows: repeat its first
        first.append(s * b + at)
        inverse.append(s * distinct + inv)
    return torch.cat(first), torch.cat(inverse)


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
    return _per_request(tokenizer, requests, raw)


def generate_slots(model: PreTrainedModel, tokenizer, groups: Sequence[Sequence[EngineRequest]],
                   decoder: Callable[[tuple[int, ...]], LeanQwen2], params: SamplingParams, *,
                   batch_size: int) -> list[list[list[GeneratedSample]]]:
    """`r.n` samples per request of each group g, group g sampled under weight slot g, in forward
    passes of at most `batch_size` rows that decode several slots together: each group's rows are
    cut into pieces of at most `batch_size`, pieces are packed into passes of S slots × b rows
    (S·b ≤ batch_size, b the pass's longest piece; shorter pieces are padded with copies of their
    first row, whose samples are dropped), and `decoder(slots)` gives the lean decoder of those
    slots (the groups' indices)."""
    flat = [[(r.prompt_ids, r.seed + j) for r in reqs for j in range(r.n)] for reqs in groups]
    pieces = [(g, k, rows[k:k + batch_size]) for g, rows in enumerate(flat) for k in range(0, len(rows), batch_size)]
    passes: list[list] = []
    for piece in pieces:
        if passes and (len(passes[-1]) + 1) * max(len(piece[2]), *(len(p[2]) for p in passes[-1])) <= batch_size:
            passes[-1].append(piece)
        else:
            passes.append([piece])
    raw: list[list] = [[None] * len(rows) for rows in flat]
    for chunk in passes:
        b = max(len(rows) for _, _, rows in chunk)
        padded = [rows + [rows[0]] * (b - len(rows)) for _, _, rows in chunk]
        out = sample_batch(model, [p for rows in padded for p, _ in rows], [s for rows in padded for _, s in rows],
                           params, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                           lean=decoder(tuple(g for g, _, _ in chunk)))
        for i, (g, k, rows) in enumerate(chunk):
            raw[g][k:k + len(rows)] = out[i * b:i * b + len(rows)]
    return [_per_request(tokenizer, reqs, rows) for reqs, rows in zip(groups, raw)]


def _per_request(tokenizer, requests: Sequence[EngineRequest], raw: list) -> list[list[GeneratedSample]]:
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
        self._slots: dict[tuple, tuple] = {}  # (seed, scale) -> served θ̂, noise ratio, fingerprint
        self._decoders: dict[tuple, tuple] = {}  # slots' keys -> lean decoder of their stacked θ̂, load checks
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
        self._decoders.clear()
        self.serve(NoiseSpec(posterior_version=version, seed=None))

    def serve(self, noise: NoiseSpec) -> ServeReport:
        served, ratio, self._fingerprint = self._slot(noise)
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(served[name])  # in place: never rebind storage, never subtract noise
        loaded_ok = self.verify()
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum, loaded_ok, ratio, scale=noise.scale)
        return self.report

    def _slot(self, noise: NoiseSpec) -> tuple[dict[str, torch.Tensor], float, tuple[int, int]]:
        """Slot `noise`'s served weights θ̂ (in the served dtype), its served-noise ratio and the
        fingerprint of every tensor it is decoded with (θ̂ and the model's frozen parameters)."""
        if noise.posterior_version != self.version:
            raise ValueError(f"engine {self.engine_id} holds version {self.version}, asked to serve "
                             f"{noise.posterior_version}: load_version first")
        if noise.seed is not None and self._sigma is None:
            raise ValueError(f"engine {self.engine_id}: a seeded slot needs σ, but version "
                             f"{self.version} was published without one")
        key = (noise.seed, noise.scale)
        if key in self._slots:
            return self._slots[key]
        theta = param_noise.perturbed_state(self._mean, self._sigma or {}, noise.seed, noise.scale)
        served = {n: t.to(self.dtype) for n, t in theta.items()}
        ratio = param_noise.served_noise_ratio_of(self._mean, theta, self.dtype)
        frozen = [p for n, p in self.model.named_parameters() if n not in served]
        entry = (served, ratio, param_noise.value_fingerprint([*served.values(), *frozen]))
        if noise.seed is not None and len(self._slots) < self.cfg.slot_cache:
            self._slots[key] = entry
        return entry

    def generate_slots(self, groups: Sequence[tuple[NoiseSpec, Sequence[EngineRequest]]],
                       params: SamplingParams) -> list[tuple[ServeReport, bool, list[list[GeneratedSample]]]]:
        """Sample each (slot, requests) group under its own slot in shared forward passes (several
        slots per pass through the lean decoder's stacked weights). Per group: the `ServeReport`
        that `serve` would give (its weight check compares the stacked weights with θ̂), whether
        they were unchanged after sampling, and the samples. The model's own weights are left as
        they were. Only where `slots_together` (dense Qwen2)."""
        self._check_running()
        if not self.slots_together:
            raise ValueError(f"engine {self.engine_id}: {type(self.model).__name__} has no lean decoder to "
                             "decode several slots together; serve and generate them one at a time")
        slots = [self._slot(noise) for noise, _ in groups]
        keys = [(noise.seed, noise.scale) for noise, _ in groups]
        used: dict[tuple[int, ...], tuple] = {}  # a pass's group indices -> its decoder, load checks

        def holds(lean: LeanQwen2, k: int, i: int) -> bool:  # decoder slot k holds exactly group i's θ̂
            return param_noise.value_fingerprint(lean.slot_tensors(k)) == slots[i][2]

        def decoder(indices: tuple[int, ...]) -> LeanQwen2:
            key = tuple(keys[i] for i in indices)
            if key not in self._decoders:
                while len(self._decoders) >= _DECODERS_KEPT:
                    self._decoders.pop(next(iter(self._decoders)))
                lean = LeanQwen2(self.model, [slots[i][0] for i in indices])
                self._decoders[key] = (lean, [holds(lean, k, i) for k, i in enumerate(indices)])
            used[indices] = self._decoders[key]
            return used[indices][0]

        samples = generate_slots(self.model, self.tokenizer, [r for _, r in groups], decoder, params,
                                 batch_size=self.cfg.batch_size)
        loaded, unchanged = [True] * len(groups), [True] * len(groups)
        for indices, (lean, checked) in used.items():  # every decoder a group's rows came from
            for k, i in enumerate(indices):
                loaded[i] = loaded[i] and checked[k]
                unchanged[i] = unchanged[i] and holds(lean, k, i)
            if not all(loaded[i] and unchanged[i] for i in indices):
                self._decoders.pop(tuple(keys[i] for i in indices), None)  # rebuilt afresh next time
        return [(ServeReport(self.version, noise.seed, self.mean_checksum, loaded[i], slots[i][1], scale=noise.scale),
                 unchanged[i], samples[i]) for i, (noise, _) in enumerate(groups)]

    def encode(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    @property
    def slots_together(self) -> bool:
        """Can `generate_slots` decode several slots in shared passes (the lean decoder applies)?"""
        return LeanQwen2.supports(self.model)

    def _check_running(self) -> None:
        if self.paused:
            raise RuntimeError(f"engine {self.engine_id} is paused: resume() before generate")

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        self._check_running()
        return generate(self.model, self.tokenizer, requests, params, batch_size=self.cfg.batch_size)

    def verify(self) -> bool:
        """The model's weights (θ̂ and the frozen ones) against the fingerprint of what was served."""
        return param_noise.value_fingerprint(self.model.parameters()) == self._fingerprint

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.model = None
