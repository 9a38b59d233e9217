"""The shared-prefix forward gives the plain forward's logits and gradients at every completion
position (to fp32 rounding), for groups with prompts and completions of different lengths; the token
log-probs and entropies from hidden states, the head in checkpointed chunks, equal a full forward's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threepo.services.model import prefix_forward
from threepo.services.model.modeling import load_model
from threepo.services.model.prefix_forward import prompt_runs, row_token_stats, shared_prefix_hidden


def _batch(group_size=4, groups=3, seed=1):
    rng, rows = np.random.default_rng(seed), []
    for _ in range(groups):
        prompt = list(rng.integers(2, 70, int(rng.integers(3, 12))))
        rows += [(prompt, list(rng.integers(2, 70, int(rng.integers(1, 9))))) for _ in range(group_size)]
    width = max(len(p) + len(c) for p, c in rows)
    ids, attn = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)], attn[i, :len(p) + len(c)] = torch.tensor(p + c), 1
        mask[i, len(p) - 1:len(p) - 1 + len(c)] = 1
    return ids, attn, mask


def test_logits_and_gradients_equal_the_plain_forward(tiny_dense_path):
    model = load_model(tiny_dense_path).train()
    ids, attn, mask = _batch()
    plain = model(input_ids=ids, attention_mask=attn).logits
    shared = shared_prefix_hidden(model, ids, mask, 4, logits=True)
    at = mask.bool()
    torch.testing.assert_close(shared[:, :-1][at], plain[:, :-1][at], atol=1e-5, rtol=1e-5)

    def grads(logits):
        model.zero_grad()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (logp * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    g_plain = grads(model(input_ids=ids, attention_mask=attn).logits)
    g_shared = grads(shared_prefix_hidden(model, ids, mask, 4, logits=True))
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-4, rtol=1e-4)


def test_only_runs_of_rows_with_one_prompt_share_it(tiny_dense_path):
    assert prompt_runs(torch.arange(8), 4) == 4 and prompt_runs(torch.arange(4, 12), 4) == 4
    # one C3PO slot's rollouts of each group (slot 1 of 4, 2 rows each, groups of 8)
    assert prompt_runs(torch.tensor([2, 3, 10, 11, 18, 19]), 8) == 2
    assert prompt_runs(torch.tensor([0, 1, 2, 4]), 4) == 0 and prompt_runs(torch.arange(2, 6), 4) == 2
    assert prompt_runs(torch.tensor([0, 1, 4]), 4) == 0 and prompt_runs(torch.tensor([], dtype=torch.long), 4) == 0
    ids, _, mask = _batch(group_size=2, groups=2)
    mask = mask.clone()
    mask[1] = torch.roll(mask[1], 1)  # row 1 claims a longer prompt than row 0 of its group
    with pytest.raises(ValueError, match="different lengths"):
        shared_prefix_hidden(load_model(tiny_dense_path), ids, mask, 2)


def test_length_buckets_split_off_long_completions_only_when_that_pads_less():
    one = prefix_forward.length_buckets(torch.tensor([3, 5, 4, 5]))  # a second pass would cost more
    assert len(one) == 1 and sorted(one[0].tolist()) == [0, 1, 2, 3]
    short, long = prefix_forward.length_buckets(torch.tensor([3] * 30 + [40, 2]), extra_pass_tokens=16)
    assert sorted(long.tolist()) == [30] and sorted(short.tolist()) == list(range(30)) + [31]
    assert prefix_forward.length_buckets(torch.tensor([7, 7, 7]))[0].tolist() == [0, 1, 2]


def test_completions_of_very_different_lengths_run_in_two_passes_with_the_plain_forwards_logits(tiny_dense_path, monkeypatch):
    model = load_model(tiny_dense_path).train()
    rng, rows = np.random.default_rng(3), []
    for g in range(4):  # 4 groups of 8: short completions and one long one
        prompt = list(rng.integers(2, 70, int(rng.integers(3, 9))))
        rows += [(prompt, list(rng.integers(2, 70, 40 if (g, k) == (2, 5) else int(rng.integers(1, 4))))) for k in range(8)]
    width = max(len(p) + len(c) for p, c in rows)
    ids, attn, mask = (torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long),
                       torch.zeros(len(rows), width - 1))
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)], attn[i, :len(p) + len(c)] = torch.tensor(p + c), 1
        mask[i, len(p) - 1:len(p) - 1 + len(c)] = 1
    passes, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: passes.append(k["input_ids"].shape) or forward(*a, **k))
    shared = shared_prefix_hidden(model, ids, mask, 8, logits=True)
    assert len(passes) == 3 and passes[-1] == (1, 40)  # prompts, the short rows, the long one
    plain = forward(input_ids=ids, attention_mask=attn).logits
    at = mask.bool()
    torch.testing.assert_close(shared[:, :-1][at], plain[:, :-1][at], atol=1e-5, rtol=1e-5)
    grads = []
    for logits in (shared, plain):
        model.zero_grad()
        (torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("run,chunk,plain", [(0, 0, True), (4, 0, True), (4, 5, True), (0, 7, True),
                                             (4, 5, False), (0, 0, False)])
def test_token_stats_from_hidden_states_in_chunks_equal_the_full_forwards(tiny_dense_path, run, chunk, plain):
    model = load_model(tiny_dense_path).train()
    assert prefix_forward.plain_head(model)  # a Qwen2's logits are its head on its body's output
    prefix_forward._PLAIN[model] = plain  # False: as for a model whose head does more (the full logits path)
    ids, attn, mask = _batch()
    targets = ids[:, 1:]

    def full():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / 0.7
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1) * mask
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1) * mask
        return logp, entropy

    def grads(logp, entropy):
        model.zero_grad()
        ((logp * mask).sum() + 0.3 * (entropy * mask).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = full()
    got = row_token_stats(model, ids, attn, mask, targets, run, 0.7, entropy=True, chunk_tokens=chunk)
    for a, b in zip(got, want):
        torch.testing.assert_close(a * mask, b, atol=1e-5, rtol=1e-5)
        assert not a[mask == 0].any()  # nothing outside the completions
    g_got, g_want = grads(*got), grads(*full())
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], atol=1e-4, rtol=1e-4)


def test_micro_batches_are_whole_prompt_runs_or_equal_sub_runs_within_the_budget():
    from threepo.services.learner.memory import micro_batches

    rows, mask = torch.arange(32), torch.zeros(32, 14)
    mask[:, 7:11] = 1  # prompts of 8 tokens, completions of 4: a row of a run of 8 costs 4 + 1 positions
    assert [len(m) for m in micro_batches(rows, 8, mask, 0, 100)] == [32]  # no budget: one
    parts = micro_batches(rows, 8, mask, 5 * 100 * 17, 100)  # 17 rows fit: two runs of 8 per part
    assert [len(m) for m in parts] == [16, 16] and torch.equal(torch.cat(parts), rows)
    # 5 rows of a whole run fit, no run does: sub-runs of 4 (a row then costs 4 + 2 positions)
    assert [len(m) for m in micro_batches(rows, 8, mask, 5 * 100 * 5, 100)] == [4] * 8
    assert [len(m) for m in micro_batches(rows, 8, mask, 1, 100)] == [1] * 32  # at least one row
    assert [len(m) for m in micro_batches(torch.arange(5), 0, mask[:5], 12 * 100 * 3, 100)] == [3, 2]


def test_every_tensor_is_built_on_the_inputs_device(tiny_dense_path):
    """With factory calls that name no device sent to `meta` and the model and batch on the CPU, a
    helper that builds an index without its inputs' device fails: what `learner.device=cuda`
    would meet with CPU-built indices."""
    model = load_model(tiny_dense_path).train()
    ids, attn, mask = _batch()
    expected = row_token_stats(model, ids, attn, mask, ids[:, 1:], 4, 1.0, entropy=True)
    with torch.device("meta"):
        found = row_token_stats(model, ids, attn, mask, ids[:, 1:], 4, 1.0, entropy=True)
    assert found[0].device.type == "cpu"
    torch.testing.assert_close(found, expected)
