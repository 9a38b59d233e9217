"""The learner's forward pass: token log-probs of completions with each group's prompt computed once
(a shared-prefix forward), from hidden states, never holding logits for a whole batch.

Every rollout of an advantage group continues the same prompt, so the prompt's keys and values are
the same for all G of them. `shared_prefix_hidden` runs the distinct prompts once (right-padded,
with gradients) through the model's body, gives each row its group's KV cache, and runs only the
completions on top of it with explicit positions — in two passes when a few long completions would
otherwise pad every row to their length (`length_buckets`) — then lays the final hidden states out
exactly as a plain forward of `batch.input_ids` would (position t predicts token t + 1). The
gradient reaches the prompt's positions through the repeated cache, summed over the group's rows —
the same gradient as the plain forward's. On the embedded default (prompts about as long as
completions) it halves the learner's FLOPs.

`row_token_stats` then applies the output head only where a completion token is predicted, in
chunks of at most `chunk_tokens` positions, each chunk's logits recomputed in the backward pass
(activation checkpointing) rather than kept: the learner never materialises [rows, L, V] logits
(at a vocabulary of 49,152 that was gigabytes per step). The log-probs are `losses.token_logprobs`
of each chunk's logits, so they equal a full forward's to fp32 rounding. A model whose logits are
not its head applied to its body's output (a soft cap, a logit scale: `plain_head` probes it once)
takes the full forward instead, still selecting the completion positions before the softmax.

Rows that come in runs sharing one prompt can use the shared prefix: the learner's whole groups, and
the drift diagnostic's rows of one C3PO slot (that slot's rollouts of each group); a mixture-of-
experts model with VP2O's routing hooks keeps the plain forward (the hooks count tokens).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from threepo.algorithms import losses

_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> does plain_head hold


def prompt_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt length, completion length) of each row from the completion mask of a TrainBatch
    (mask[r, t] = 1 where position t predicts a completion token, i.e. t ∈ [P - 1, P - 1 + n))."""
    n = mask.sum(1).long()
    first = mask.argmax(1)
    return first + 1, n


def prompt_runs(rows: torch.Tensor, group_size: int) -> int:
    """k when `rows` (indices into a batch ordered by groups of `group_size`) come in consecutive
    runs of k rows of one group each — k rows sharing a prompt, e.g. whole groups (k = group_size)
    or one C3PO slot's rollouts of every group — and 0 when they do not."""
    if not len(rows):
        return 0
    _, counts = torch.unique_consecutive(torch.div(rows, group_size, rounding_mode="floor"), return_counts=True)
    return int(counts[0]) if bool((counts == counts[0]).all()) else 0


def length_buckets(comp_len: torch.Tensor, extra_pass_tokens: int = 128) -> list[torch.Tensor]:
    """Rows split into at most two sets by completion length, each run padded to its own longest:
    the short rows (length ≤ L) and the rest, with L chosen to pad the fewest positions, counting a
    second pass as `extra_pass_tokens` positions of its own cost. One set when that pads least."""
    order = torch.argsort(comp_len, stable=True)
    lengths = comp_len[order].tolist()
    rows, longest = len(lengths), lengths[-1] if lengths else 0
    best, cut = rows * longest, rows
    for k in range(1, rows):  # the first k rows of the sorted order are the short set
        if lengths[k] != lengths[k - 1]:
            cost = k * lengths[k - 1] + (rows - k) * longest + extra_pass_tokens
            if cost < best:
                best, cut = cost, k
    return [order] if cut == rows else [order[:cut], order[cut:]]


def plain_head(model) -> bool:
    """Are the model's logits its output head applied to its body's final hidden states? (Probed
    once per model on three tokens: true for Llama, Mistral, Qwen2/3 and their MoE variants.)"""
    if model not in _PLAIN:
        ids = torch.tensor([[1, 2, 3]], device=next(model.parameters()).device)
        with torch.no_grad():
            full = model(input_ids=ids).logits
            head = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state)
        _PLAIN[model] = full.shape == head.shape and torch.allclose(full, head, rtol=1e-4, atol=1e-5)
    return _PLAIN[model]


def row_hidden(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, run: int) -> torch.Tensor:
    """Final hidden states [R, L, H] of rows of a TrainBatch (`input_ids`, `attn`, `mask` [R, L]):
    with each prompt computed once when they come in runs of `run` > 1 rows sharing one
    (`prompt_runs`), else a plain forward of the model's body."""
    if run > 1:
        return shared_prefix_hidden(model, input_ids, mask, run)
    return model.base_model(input_ids=input_ids, attention_mask=attn).last_hidden_state


def row_token_stats(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                    run: int, temperature: float, *, entropy: bool = False,
                    chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs [R, T] of `targets` [R, T] under `model` at `temperature` where `mask` [R, T]
    marks a completion token (0 elsewhere), and their entropies when `entropy`: the head applied to
    at most `chunk_tokens` positions at a time (0: all at once), each chunk recomputed in the
    backward pass where gradients flow."""
    where = mask[:, :targets.shape[1]].bool().nonzero(as_tuple=True)
    hidden, head = _at_positions(model, input_ids, attn, mask, run, where)
    picked = targets[where]
    size = chunk_tokens or max(1, len(picked))
    parts = []
    for start in range(0, len(picked), size):
        args = (head, hidden[start:start + size], picked[start:start + size], temperature, entropy)
        many = torch.is_grad_enabled() and len(picked) > size
        parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if many else _chunk_stats(*args))
    logp = hidden.new_zeros(targets.shape, dtype=torch.float32)
    ent = hidden.new_zeros(targets.shape, dtype=torch.float32) if entropy else None
    if parts:
        logp = logp.index_put(where, torch.cat([p[0] for p in parts]))
        if entropy:
            ent = ent.index_put(where, torch.cat([p[1] for p in parts]))
    return logp, ent


def _chunk_stats(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    logits = head(hidden).float()[None]  # [1, c, V]
    logp = losses.token_logprobs(logits, targets[None], temperature)[0]
    return (logp, losses.entropy_from_logits(logits, temperature)[0] if entropy else logp)


def row_logprobs(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                 run: int, temperature: float, chunk_tokens: int = 0) -> torch.Tensor:
    """Token log-probs [R, T] of `targets` (`row_token_stats` without entropies)."""
    return row_token_stats(model, input_ids, attn, mask, targets, run, temperature, chunk_tokens=chunk_tokens)[0]


def position_logits(model, input_ids: torch.Tensor, attn: torch.Tensor, where: torch.Tensor,
                    mask: torch.Tensor | None = None, run: int = 0) -> torch.Tensor:
    """Logits [P, V] (fp32) at the positions `where` [R, L-1] marks, of a plain forward of the rows, or
    with `run` > 1 of the shared-prefix forward of rows in runs of `run` sharing a prompt (`mask`: their
    completion mask, which `where` must lie in): the head on those positions only where `plain_head`
    holds, else the model's own logits selected."""
    hidden, head = _at_positions(model, input_ids, attn, where if run <= 1 else mask, run, where)
    return head(hidden).float()


def _at_positions(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, run: int, where):
    """(x, head) with head(x) the logits [P, V] at the positions `where` selects of [R, L-1]: the final
    hidden states there and the output head where `plain_head` holds (the head then runs on those
    positions only, in chunks if the caller likes), else the model's own logits there and the identity."""
    if plain_head(model):
        return row_hidden(model, input_ids, attn, mask, run)[:, :-1][where], model.get_output_embeddings()
    return _full_logits(model, input_ids, attn, mask, run)[:, :-1][where], torch.nn.Identity()


def _full_logits(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, run: int) -> torch.Tensor:
    if run > 1:
        return shared_prefix_hidden(model, input_ids, mask, run, logits=True)
    return model(input_ids=input_ids, attention_mask=attn).logits


def shared_prefix_hidden(model, input_ids: torch.Tensor, mask: torch.Tensor, group_size: int, *,
                         logits: bool = False) -> torch.Tensor:
    """Final hidden states [R, L, H] of `input_ids` [R, L] (right-padded prompt + completion rows, in
    consecutive groups of `group_size` sharing a prompt), equal to the body's forward of each row at
    every position that predicts a completion token (other positions are 0); `logits`: the model's
    logits [R, L, V] instead. The completions run in at most two passes of rows of similar length
    (`length_buckets`), each on its rows' prompt cache."""
    rows, width = input_ids.shape
    if rows % group_size:
        raise ValueError(f"{rows} rows are not whole groups of {group_size}")
    prompt_len, comp_len = prompt_spans(mask)
    device = input_ids.device
    heads = torch.arange(0, rows, group_size, device=device)
    p_len = prompt_len[heads]
    if not torch.equal(prompt_len.view(-1, group_size), p_len[:, None].expand(-1, group_size)):
        raise ValueError("rows of a group have prompts of different lengths: not one shared prompt")
    p_max = int(p_len.max())
    cols = torch.arange(p_max, device=device)
    prompt_attn = (cols[None, :] < p_len[:, None]).long()
    prompts = torch.where(prompt_attn.bool(), input_ids[heads, :p_max], 0)
    net = model if logits else model.base_model
    out = net(input_ids=prompts, attention_mask=prompt_attn, use_cache=True)
    first = out.logits if logits else out.last_hidden_state
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    # lay out like a plain forward: position P - 1 (last prompt token) predicts completion token 0,
    # position P + j predicts completion token j + 1 (the completion's own outputs)
    laid = first.new_zeros((rows, width, first.shape[-1]))
    row_of = torch.arange(rows, device=device)
    laid = laid.index_put((row_of, prompt_len - 1), first[row_of // group_size, p_len.repeat_interleave(group_size) - 1])
    for idx in length_buckets(comp_len):
        laid = _completion_states(net, logits, laid, input_ids[idx], idx, prompt_len[idx], comp_len[idx],
                                  prompt_attn[idx // group_size], [(k[idx // group_size], v[idx // group_size])
                                                                   for k, v in layers])
    return laid


def _completion_states(net, logits: bool, laid, ids, idx, prompt_len, comp_len, prompt_attn, cache_layers):
    """`laid` with the completion positions of rows `idx` filled in: their completion tokens
    (right-padded, at positions P, P + 1, ...) run through `net` on their prompts' keys and values."""
    from transformers import DynamicCache

    c_max, width = int(comp_len.max()), ids.shape[1]
    j = torch.arange(c_max, device=ids.device)
    take = (j[None, :] < comp_len[:, None])
    src = (prompt_len[:, None] + j[None, :]).clamp(max=width - 1)
    completions = torch.where(take, ids.gather(1, src), 0)
    attn = torch.cat([prompt_attn, take.long()], 1)
    positions = prompt_len[:, None] + j[None, :]
    cache = DynamicCache(cache_layers, config=net.config)
    out = net(input_ids=completions, attention_mask=attn, position_ids=positions, past_key_values=cache,
              use_cache=False)
    states = out.logits if logits else out.last_hidden_state
    r_idx, j_idx = take[:, :-1].nonzero(as_tuple=True) if c_max > 1 else (idx[:0], idx[:0])
    keep = j_idx + 1 < comp_len[r_idx]  # the last completion token predicts nothing
    r_idx, j_idx = r_idx[keep], j_idx[keep]
    return laid.index_put((idx[r_idx], prompt_len[r_idx] + j_idx), states[r_idx, j_idx])
