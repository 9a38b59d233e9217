"""The hf engine's decoding loop: sampling a batch of rows from a model or a lean decoder.

Our own loop over the forward with a KV cache, so that the reported behaviour log-probs are exactly
those of the sampling distribution (temperature, top-k, top-p; algorithms/sampling.py) and nothing is
hidden in `generate`'s logits processors; temperature 0 is greedy (evaluation). Each sampled row
draws from the counter stream of its own request seed, so its draws do not depend on what else is in
the batch (its tokens reproduce where its logits do: on the CPU, to fp32 rounding; not exactly on a
GPU, whose kernels depend on the batch's shape); a row ends at any of the call's stop tokens (the prompt encoder's: EOS, the
generation config's, the template's end of turn). `generate_slots` decodes several weight sets'
rows in shared passes through a lean decoder (engines/lean_decoder.py); a prompt repeated under one
set (a request's n samples) is prefilled once.

Not here: which weights are served, slots and their checks (engines/hf.py, engines/slot_bank.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from threepo.algorithms.sampling import row_uniforms, sample_with_uniforms, sampling_logprobs
from threepo.services.sampling.engines import lean_decoder
from threepo.services.sampling.engines.base import EngineRequest
from threepo.services.sampling.engines.lean_decoder import LeanDecoder, WeightLayout
from threepo.services.wire.messages import GeneratedSample, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingParams, *, stop_ids: Sequence[int], pad_id: int,
                 lean: LeanDecoder | None = None) -> list[tuple[list[int], list[float], str]]:
    """Sample one completion per prompt, row b drawing from the counter stream of `seeds[b]` (or
    greedily at temperature 0). Returns (token ids, behaviour log-probs, finish reason) per row.
    `lean`: decode with this lean decoder (its S weight sets take S equal consecutive groups of rows)."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):  # left padding keeps every row's last token aligned
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long, device="cpu")
        attn[row, width - len(ids):] = 1
    device = lean.device if lean is not None else next(model.parameters()).device
    input_ids, attn = input_ids.to(device), attn.to(device)  # built on the host, moved once
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    step_logits = _stepper(model, input_ids, attn, positions, params.max_new_tokens, lean)
    row_seeds, stops = np.array(seeds, dtype=np.uint64), torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    tokens, logps = [], []
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=device)
    logits = step_logits(None)
    for step in range(params.max_new_tokens):
        if params.temperature == 0:  # greedy: the chosen token has probability 1 under the rule
            tok, tok_logp = logits.argmax(-1), torch.zeros(len(prompt_ids), device=device)
        else:
            logp = sampling_logprobs(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            tok, tok_logp = sample_with_uniforms(logp, row_uniforms(row_seeds, step))
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        logps.append(tok_logp.float().masked_fill(done, 0.0))
        done = done | torch.isin(tok, stops)
        if bool(done.all()) or step + 1 == params.max_new_tokens:
            break
        logits = step_logits(tok)
    return _unpad(torch.stack(tokens, 1), torch.stack(logps, 1), set(stop_ids))


def _stepper(model: PreTrainedModel, input_ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor,
             max_new_tokens: int, lean: LeanDecoder | None = None):
    """A function giving the next-token logits [B, V]: of the prompt (called with None), then after
    each sampled token. With `lean` the lean decoder's, else transformers' forward with its KV cache."""
    width = input_ids.shape[1]
    if lean is not None:
        cache = lean.new_cache(len(input_ids), width + max_new_tokens, lean.dtype)
        keys = torch.zeros((len(input_ids), width + max_new_tokens), dtype=torch.bool, device=input_ids.device)
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


def _shared_prefill(lean: LeanDecoder, input_ids: torch.Tensor, positions: torch.Tensor, cache: list,
                    keys: torch.Tensor) -> torch.Tensor:
    """The prompt's logits [B, V], its keys and values written into `cache`, with each distinct
    (prompt, weight set) computed once: rows that repeat a prompt under the same set (a request's
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


@torch.inference_mode()
def completion_logits(lean: LeanDecoder | None, model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]],
                      completions: Sequence[Sequence[int]], positions: int) -> torch.Tensor:
    """Logits [N, V] where each row's first `positions` completion tokens are predicted (position t of
    a row from its prompt and completion tokens < t), rows in order, N = Σ_r min(len_r, positions): the
    rows teacher-forced through `lean` (each distinct prompt prefilled once, then every completion
    position in one pass; in the decoder's compute dtype) or, without one, `model`'s forward."""
    lengths = [min(len(c), positions) for c in completions]
    if lean is None:
        return _model_completion_logits(model, prompt_ids, completions, lengths)
    width, rows, longest = max(len(p) for p in prompt_ids), len(prompt_ids), max(lengths)
    input_ids = torch.zeros((rows, width), dtype=torch.long)
    keys = torch.zeros((rows, width + longest), dtype=torch.bool)
    for r, ids in enumerate(prompt_ids):  # left padding: every row's last prompt token at width - 1
        input_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        keys[r, width - len(ids):width] = True
    input_ids, keys = input_ids.to(lean.device), keys.to(lean.device)
    positions_ = (keys[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    cache = lean.new_cache(rows, width + longest, lean.dtype)
    first = _shared_prefill(lean, input_ids, positions_, cache, keys).float()  # predicts completion token 0
    if longest < 2:
        return first[[r for r, n in enumerate(lengths) if n]]
    fed = torch.zeros((rows, longest - 1), dtype=torch.long)
    for r, c in enumerate(completions):
        fed[r, :lengths[r] - 1] = torch.tensor(list(c[:lengths[r] - 1]), dtype=torch.long)
    keys[:, width:] = True  # a position past a row's end sees only its own row's padding, and is not read
    steps = torch.arange(longest - 1, device=lean.device)
    at = steps[None] < torch.tensor(lengths, device=lean.device)[:, None] - 1
    rest = lean.forward(fed.to(lean.device), positions_[:, -1:] + 1 + steps, cache, width, keys[:, :-1], at=at).float()
    out, used = [], 0
    for r, n in enumerate(lengths):
        if n:
            out += [first[r:r + 1], rest[used:used + n - 1]]
            used += n - 1
    return torch.cat(out)


def _model_completion_logits(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]],
                             completions: Sequence[Sequence[int]], lengths: list[int]) -> torch.Tensor:
    """`completion_logits` through transformers' forward of each whole row (right-padded), fp32 out."""
    device = next(model.parameters()).device
    seqs = [list(p) + list(c[:n]) for p, c, n in zip(prompt_ids, completions, lengths)]
    ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, seq in enumerate(seqs):
        ids[r, :len(seq)], attn[r, :len(seq)] = torch.tensor(seq, dtype=torch.long), 1
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
    return torch.cat([logits[r, len(p) - 1:len(p) - 1 + n].float() for r, (p, n) in enumerate(zip(prompt_ids, lengths))])


def _distinct_rows(rows: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For `rows` [B, W] in `slots` equal consecutive blocks (one per weight set): the first row of
    each distinct row of each block, U per block (U the most distinct rows of any block; a block with
    fewer repeats its first), and each row's index among those S·U; None if no block repeats a row."""
    b = len(rows) // slots
    blocks = [torch.unique(rows[s * b:(s + 1) * b], dim=0, return_inverse=True)[1] for s in range(slots)]
    distinct = max(int(inv.max()) + 1 for inv in blocks)
    if distinct == b:
        return None
    first, inverse = [], []
    for s, inv in enumerate(blocks):
        at = torch.full((distinct,), b, dtype=torch.long, device=rows.device).scatter_reduce_(
            0, inv, torch.arange(b, device=rows.device), "amin")
        at[at == b] = at[0]  # this block has fewer distinct rows: repeat its first
        first.append(s * b + at)
        inverse.append(s * distinct + inv)
    return torch.cat(first), torch.cat(inverse)


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x); vLLM pins older ones."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _unpad(tokens: torch.Tensor, logps: torch.Tensor, stops: set[int]) -> list[tuple[list[int], list[float], str]]:
    results = []
    for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist()):
        end = next((i + 1 for i, t in enumerate(row_tokens) if t in stops), None)
        if end is not None:
            results.append((row_tokens[:end], row_logps[:end], "stop"))
        else:
            results.append((row_tokens, row_logps, "length"))
    return results


def stops_and_pad(tokenizer, params: SamplingParams) -> tuple[tuple[int, ...], int]:
    """The call's stop tokens (the tokenizer's EOS when it names none) and the padding token."""
    stops = params.stop_token_ids or (tokenizer.eos_token_id,)
    return stops, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]


def generate(model: PreTrainedModel, tokenizer, requests: Sequence[EngineRequest], params: SamplingParams, *,
             batch_size: int, lean: LeanDecoder | None = None) -> list[list[GeneratedSample]]:
    """`r.n` samples per request from `model` as it is now (or the lean decoder `lean`), in batches
    of `batch_size` rows."""
    flat = [(r.prompt_ids, r.seed + j) for r in requests for j in range(r.n)]
    stops, pad = stops_and_pad(tokenizer, params)
    raw = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start:start + batch_size]
        raw += sample_batch(model, [p for p, _ in chunk], [s for _, s in chunk], params, stop_ids=stops,
                            pad_id=pad, lean=lean)
    return _per_request(tokenizer, requests, raw)


def generate_slots(model: PreTrainedModel, tokenizer, groups: Sequence[Sequence[EngineRequest]],
                   decoder: Callable[[tuple[int, ...]], LeanDecoder], params: SamplingParams, *,
                   batch_size: int, max_slots: int, after: Callable[[tuple[int, ...]], None] = lambda _: None
                   ) -> list[list[list[GeneratedSample]]]:
    """`r.n` samples per request of each group g, group g sampled under weight slot g, in forward
    passes of at most `batch_size` rows and `max_slots` slots that decode several slots together:
    each group's rows are cut into pieces of at most `batch_size`, pieces are packed into passes of
    S slots × b rows (S·b ≤ batch_size, b the pass's longest piece; shorter pieces are padded with
    copies of their first row, whose samples are dropped); `decoder(slots)` gives the lean decoder
    of those slots (the groups' indices) and `after(slots)` is called once their pass is decoded."""
    flat = [[(r.prompt_ids, r.seed + j) for r in reqs for j in range(r.n)] for reqs in groups]
    pieces = [(g, k, rows[k:k + batch_size]) for g, rows in enumerate(flat) for k in range(0, len(rows), batch_size)]
    passes: list[list] = []
    for piece in pieces:
        last = passes[-1] if passes else []
        if (last and len({g for g, _, _ in last} | {piece[0]}) <= max_slots
                and (len(last) + 1) * max(len(piece[2]), *(len(p[2]) for p in last)) <= batch_size):
            last.append(piece)
        else:
            passes.append([piece])
    stops, pad = stops_and_pad(tokenizer, params)
    raw: list[list] = [[None] * len(rows) for rows in flat]
    for chunk in passes:
        b = max(len(rows) for _, _, rows in chunk)
        padded = [rows + [rows[0]] * (b - len(rows)) for _, _, rows in chunk]
        slots = tuple(g for g, _, _ in chunk)
        out = sample_batch(model, [p for rows in padded for p, _ in rows], [s for rows in padded for _, s in rows],
                           params, stop_ids=stops, pad_id=pad, lean=decoder(slots))
        after(slots)
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


def own_decoder(model: PreTrainedModel) -> LeanDecoder | None:
    """A lean decoder over a copy of a live model's weights (None where the family has none): for
    evaluating a model in training, whose parameters are not a flat weight set."""
    if not lean_decoder.supports(model):
        return None
    layout = WeightLayout.of(model, list(dict(model.named_parameters())))
    first = next(model.parameters())
    sets = torch.empty(1, layout.numel, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for name, view in layout.views(sets[0]).items():
            view.copy_(dict(model.named_parameters())[name])
    return LeanDecoder(model, layout, sets)
