"""The learner's forward pass with each group's prompt computed once (a shared-prefix forward).

Every rollout of an advantage group continues the same prompt, so the prompt's keys and values are
the same for all G of them. `shared_prefix_logits` runs the distinct prompts once (right-padded,
with gradients), gives each row its group's KV cache, and runs only the completions on top of it
with explicit positions — in two passes when a few long completions would otherwise pad every row
to their length (`length_buckets`) — then lays the logits out exactly as a plain forward of
`batch.input_ids` would (position t predicts token t + 1), so every loss and diagnostic downstream
is unchanged. The gradient reaches the prompt's positions through the repeated cache, summed over
the group's rows — the same gradient as the plain forward's. On the embedded default (prompts about
as long as completions) it halves the learner's FLOPs.

Rows that come in runs sharing one prompt can use it: the learner's whole groups, and the drift
diagnostic's rows of one C3PO slot (that slot's rollouts of each group); a mixture-of-experts model
with VP2O's routing hooks keeps the plain forward (the hooks count tokens).
"""

from __future__ import annotations

import torch

from threepo.algorithms import losses


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


def row_logits(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, run: int) -> torch.Tensor:
    """Logits [R, L, V] of rows of a TrainBatch (`input_ids`, `attn`, `mask` [R, L]): with each
    prompt computed once when they come in runs of `run` > 1 rows sharing one (`prompt_runs`),
    else a plain forward."""
    if run > 1:
        return shared_prefix_logits(model, input_ids, mask, run)
    return model(input_ids=input_ids, attention_mask=attn).logits


def row_logprobs(model, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                 run: int, temperature: float) -> torch.Tensor:
    """Token log-probs [R, T] of `targets` [R, T] under `model` at `temperature` (`row_logits`:
    position t predicts token t + 1)."""
    return losses.token_logprobs(row_logits(model, input_ids, attn, mask, run)[:, :-1], targets, temperature)


def shared_prefix_logits(model, input_ids: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Logits [R, L, V] of `input_ids` [R, L] (right-padded prompt + completion rows, in consecutive
    groups of `group_size` sharing a prompt), equal to `model(input_ids, attention_mask).logits` at
    every position that predicts a completion token (other positions are 0). The completions run in
    at most two passes of rows of similar length (`length_buckets`), each on its rows' prompt cache."""
    rows, width = input_ids.shape
    if rows % group_size:
        raise ValueError(f"{rows} rows are not whole groups of {group_size}")
    prompt_len, comp_len = prompt_spans(mask)
    heads = torch.arange(0, rows, group_size)
    p_len = prompt_len[heads]
    if not torch.equal(prompt_len.view(-1, group_size), p_len[:, None].expand(-1, group_size)):
        raise ValueError("rows of a group have prompts of different lengths: not one shared prompt")
    p_max = int(p_len.max())
    cols = torch.arange(p_max)
    prompt_attn = (cols[None, :] < p_len[:, None]).long()
    prompts = torch.where(prompt_attn.bool(), input_ids[heads, :p_max], 0)
    out = model(input_ids=prompts, attention_mask=prompt_attn, use_cache=True)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    # lay out like a plain forward: position P - 1 (last prompt token) predicts completion token 0,
    # position P + j predicts completion token j + 1 (the completion's own logits)
    logits = out.logits.new_zeros((rows, width, out.logits.shape[-1]))
    row_of = torch.arange(rows)
    logits = logits.index_put((row_of, prompt_len - 1), out.logits[row_of // group_size, p_len.repeat_interleave(group_size) - 1])
    for idx in length_buckets(comp_len):
        logits = _completion_logits(model, logits, input_ids[idx], idx, prompt_len[idx], comp_len[idx],
                                    prompt_attn[idx // group_size], [(k[idx // group_size], v[idx // group_size]) for k, v in layers])
    return logits


def _completion_logits(model, logits, ids, idx, prompt_len, comp_len, prompt_attn, cache_layers):
    """`logits` with the completion positions of rows `idx` filled in: their completion tokens
    (right-padded, at positions P, P + 1, ...) run on their prompts' keys and values."""
    from transformers import DynamicCache

    c_max, width = int(comp_len.max()), ids.shape[1]
    j = torch.arange(c_max)
    take = (j[None, :] < comp_len[:, None])
    src = (prompt_len[:, None] + j[None, :]).clamp(max=width - 1)
    completions = torch.where(take, ids.gather(1, src), 0)
    attn = torch.cat([prompt_attn, take.long()], 1)
    positions = prompt_len[:, None] + j[None, :]
    cache = DynamicCache(cache_layers, config=model.config)
    comp_logits = model(input_ids=completions, attention_mask=attn, position_ids=positions,
                        past_key_values=cache, use_cache=False).logits
    r_idx, j_idx = take[:, :-1].nonzero(as_tuple=True) if c_max > 1 else (idx[:0], idx[:0])
    keep = j_idx + 1 < comp_len[r_idx]  # the last completion token predicts nothing
    r_idx, j_idx = r_idx[keep], j_idx[keep]
    return logits.index_put((idx[r_idx], prompt_len[r_idx] + j_idx), comp_logits[r_idx, j_idx])
