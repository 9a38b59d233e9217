"""How much of an update the learner runs in one forward and backward (`learner.activation_mb`).

An estimate, from the model's config, of the activation memory one token position holds until the
backward pass — per decoder layer about ten hidden-width vectors (norms, q/k/v, attention output,
residuals), five MLP-width ones (gate, up, their product and activation) and one attention row over
the sequence; with gradient checkpointing one hidden-width vector per layer plus one layer's worth —
sets how many rows one micro-batch takes: rows are split into consecutive micro-batches of whole
prompt runs (the shared-prefix forward computes each prompt once per run), or of equal sub-runs where
one run does not fit, whose positions fit the budget. The output head takes a quarter of the budget for logits at a time
(`prefix_forward.row_token_stats`). Estimates, not measurements: `benchmarks/real_model.py` reports
the learner's measured peak.
"""

from __future__ import annotations

import torch


def bytes_per_position(model, width: int, checkpointing: bool) -> int:
    """Estimated activation bytes one position of a `width`-long row holds through the backward."""
    config, element_bytes = model.config, next(model.parameters()).element_size()
    hidden, mlp = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    layer = 10 * hidden + 5 * mlp + config.num_attention_heads * width
    layers = config.num_hidden_layers
    return element_bytes * (layers * hidden + layer if checkpointing else layers * layer)


def micro_batches(rows: torch.Tensor, run: int, mask: torch.Tensor, budget_bytes: int,
                  per_position: int) -> list[torch.Tensor]:
    """`rows` (in runs of `run` consecutive rows sharing a prompt; 0 or 1: no runs) cut into
    consecutive micro-batches whose positions fit `budget_bytes` at `per_position` bytes each: whole
    runs, or where one run does not fit, equal sub-runs of it (each still computes its prompt once,
    a run's prompt then once per sub-run), at least one row each; one micro-batch when
    `budget_bytes` is 0 or all rows fit. `mask`: the rows' completion mask (prompt and completion
    lengths: a row of a sub-run of d costs its completion and 1/d of its prompt)."""
    from threepo.services.model.prefix_forward import prompt_spans

    if not budget_bytes:
        return [rows]
    prompt, completion = (int(x.max()) for x in prompt_spans(mask))

    def fit(d: int) -> int:  # rows of sub-runs of d that fit the budget
        positions = completion + (-(-prompt // d) if d > 1 else prompt)
        return budget_bytes // max(1, positions * per_position)

    step = max(run, 1)
    if step > 1 and fit(step) < step:
        step = next((d for d in range(step - 1, 0, -1) if run % d == 0 and fit(d) >= d), 1)
    size = max(step, fit(step) // step * step)
    return [rows[i:i + size] for i in range(0, len(rows), size)] if len(rows) > size else [rows]


def head_chunk(config, budget_bytes: int) -> int:
    """Positions whose fp32 logits (and their softmax in the backward) fit a quarter of the budget
    (0: all at once)."""
    return max(1, budget_bytes // (4 * 3 * 4 * config.vocab_size)) if budget_bytes else 0


def combine_micro(diag: list[tuple[float, int, dict]]) -> dict[str, float]:
    """One update's diagnostics from its micro-batches' (tokens, rows, metrics): the loss summed
    (each part is over the whole update's denominators), the mean importance weight per sequence
    weighted by rows, every other figure (per-token means) by tokens."""
    tokens, rows = sum(t for t, _, _ in diag) or 1.0, sum(r for _, r, _ in diag) or 1

    def combined(key: str) -> float:
        if key == "loss":
            return sum(m[key] for _, _, m in diag)
        if key == "is_weight_mean":
            return sum(r * m[key] for _, r, m in diag) / rows
        return sum(t * m[key] for t, _, m in diag) / tokens
    return {k: combined(k) for k in diag[0][2]}


def denominators(mask: torch.Tensor) -> dict[str, float]:
    """The loss denominators of `mask` [R, T] (`losses.aggregate_loss`: tokens, sequences with a token)."""
    return {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(1) > 0).sum())}


def over_micro_batches(parts: list[torch.Tensor], mask: torch.Tensor, advantages: torch.Tensor,
                       logp_prox: torch.Tensor | None, backward) -> tuple[dict, torch.Tensor]:
    """`backward(rows, advantages, π_prox log-probs)` on each micro-batch of rows `parts` (consecutive:
    `advantages` and `logp_prox` are the concatenated rows'); their combined diagnostics and token
    log-probs, in row order. `mask`: the batch's completion mask."""
    diag, logps, at = [], [], 0
    for part in parts:
        here = slice(at, at + len(part))
        at += len(part)
        metrics, logp = backward(part, advantages[here], None if logp_prox is None else logp_prox[here])
        diag.append((float(mask[part].sum()), len(part), metrics))
        logps.append(logp)
    return combine_micro(diag), torch.cat(logps)
