"""Policy-gradient losses (algorithms.md §0.1–§0.5, §5.4, §5.5): hand cases, loop references,
autograd checks and invariants, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from threepo.algorithms.losses import (
    aggregate_loss,
    clipped_surrogate,
    decoupled_ppo_loss,
    entropy_from_logits,
    kl_cov_loss,
    kl_penalty,
    token_logprobs,
)

F64 = torch.float64


def _random_batch(b=5, t=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    logp_old = logp + 0.4 * torch.randn(b, t, generator=gen, dtype=F64)
    adv = torch.randn(b, generator=gen, dtype=F64)
    mask = (torch.rand(b, t, generator=gen) < 0.8).to(F64)
    mask[:, 0] = 1.0
    return logp, logp_old, adv, mask


# ---------------------------------------------------------------- clipped surrogate


def test_clipped_surrogate_by_hand():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 1.1, 4.0]], dtype=F64)
    logp_old = torch.zeros(2, 4, dtype=F64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 4, dtype=F64)
    loss, metrics = clipped_surrogate(ratios.log(), logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    # A = +1: r = 1.5 → max(−1.5, −1.2) = −1.2 (clipped); r = 0.5 → max(−0.5, −0.8) = −0.5; r = 1.1 → −1.1
    # A = −1: r = 1.5 → max(1.5, 1.2) = 1.5; r = 0.5 → max(0.5, 0.8) = 0.8 (clipped); r = 4 → 4
    expected = torch.tensor([[-1.2, -0.5, -1.1, -1.0], [1.5, 0.8, 1.1, 4.0]], dtype=F64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # 2 of 8 tokens clipped: one high (A > 0), one low (A < 0)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 8)
    assert float(metrics["clip_frac_high"]) == pytest.approx(1 / 8)
    assert float(metrics["clip_frac_low"]) == pytest.approx(1 / 8)
    # dual clip c = 3 caps the A < 0 loss at −A·c = 3: r = 4 → min(4, 3) = 3, the rest unchanged
    loss, metrics = clipped_surrogate(ratios.log(), logp_old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    torch.testing.assert_close(loss[1], torch.tensor([1.5, 0.8, 1.1, 3.0], dtype=F64))
    assert float(metrics["dual_clip_frac"]) == pytest.approx(1 / 8)
    # clip-higher (DAPO, ε_high = 0.28): r = 1.5 with A = +1 → max(−1.5, −1.28) = −1.28
    loss, _ = clipped_surrogate(ratios.log(), logp_old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert float(loss[0, 0]) == pytest.approx(-1.28)


def test_clipped_surrogate_matches_loop_reference_and_autograd():
    logp, logp_old, adv, mask = _random_batch()
    logp.requires_grad_(True)
    loss, _ = clipped_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    loss.sum().backward()
    loss = loss.detach()
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            a, r = float(adv[i]), math.exp(float(logp.detach()[i, j] - logp_old[i, j]))
            unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.28)
            value = max(unclipped, clipped)
            if a < 0:
                value = min(value, -a * 3.0)
            # gradient d/dlogp: −A r on the unclipped branch, 0 on a clipped or dual-clipped one
            grad = -a * r if value == unclipped and not (a < 0 and value == -a * 3.0) else 0.0
            if mask[i, j] == 0:
                value, grad = 0.0, 0.0
            assert float(loss[i, j]) == pytest.approx(value, rel=1e-12, abs=1e-12)
            assert float(logp.grad[i, j]) == pytest.approx(grad, rel=1e-12, abs=1e-12)


def test_clipped_surrogate_per_token_advantages_and_masked_garbage():
    logp, logp_old, adv, mask = _random_batch()
    loss_b, _ = clipped_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    loss_bt, _ = clipped_surrogate(logp, logp_old, adv[:, None].expand_as(logp), mask, eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss_b, loss_bt, rtol=0, atol=0)
    # padding holding extreme values yields exactly 0 and finite metrics
    logp_old = torch.where(mask.bool(), logp_old, torch.full_like(logp_old, -1e4))
    loss, metrics = clipped_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert bool((loss[mask == 0] == 0).all()) and all(math.isfinite(float(v)) for v in metrics.values())


# ---------------------------------------------------------------- aggregation


def test_aggregate_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    # token-mean: (1 + 2 + 3 + 4)/4 = 2.5
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(2.5)
    # seq-mean-token-mean: (6/3 + 4/1)/2 = 3
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    # seq-mean-token-sum: (6 + 4)/2 = 5
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    # seq-mean-token-sum-norm, max_len 4: 10 / (2 · 4) = 1.25   (verl would give 10/4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_len=4)) == pytest.approx(1.25)


def test_aggregate_loss_edge_cases():
    loss = torch.tensor([[1.0, 2.0], [5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=F64)
    # a fully masked (e.g. rejected) sequence leaves N: (1 + 2)/1 = 3
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(3.0)
    assert float(aggregate_loss(loss, torch.zeros_like(mask), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(loss, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_denominators_sum_to_the_full_batch(mode):
    logp, logp_old, adv, mask = _random_batch(b=6)
    loss, _ = clipped_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    full = aggregate_loss(loss, mask, mode, max_len=7)
    parts = sum(aggregate_loss(loss[s], mask[s], mode, max_len=7, num_tokens=float(mask.sum()), num_seqs=6)
                for s in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- KL, entropy, log-probs


def test_kl_penalty_by_hand_and_straight_through_gradient():
    ref = torch.zeros(1, 1, dtype=F64)
    logp = torch.full((1, 1), 0.5, dtype=F64, requires_grad=True)  # x = 0.5
    expected = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) + 0.5 - 1}  # k3 = 0.1065306597…
    grads = {"k1": 1.0, "k2": 0.5, "k3": 1 - math.exp(-0.5)}  # d/dx: 1, x, 1 − e^{−x}
    for kind in ("k1", "k2", "k3"):
        for suffix in ("", "+"):
            logp.grad = None
            value = kl_penalty(logp, ref, kind + suffix)
            value.sum().backward()
            assert float(value.detach()) == pytest.approx(expected[kind], rel=1e-12)
            # "+": the value of <kind>, the gradient of k2 (= x = 0.5)
            assert float(logp.grad) == pytest.approx(0.5 if suffix else grads[kind], rel=1e-12)
    # k3 clamps: x = −30 → y = clamp(30, ±20) = 20 → e^20 − 21 → clamped to 10
    assert float(kl_penalty(torch.full((1, 1), -30.0, dtype=F64), ref, "k3")) == 10.0
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")


def test_kl_estimators_are_unbiased_for_sampled_tokens():
    # tokens drawn from π_θ: E[k1] = E[k3] = KL(π_θ ‖ π_ref) (k3 is the DeepSeekMath estimator)
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    exact = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=gen)[None]
    for kind in ("k1", "k3"):
        estimate = float(kl_penalty(p.log()[tokens], q.log()[tokens], kind).mean())
        assert estimate == pytest.approx(exact, rel=0.02)


def test_entropy_from_logits_matches_definition():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=F64) * 3
    for temperature in (1.0, 0.6):
        probs = torch.softmax(logits / temperature, dim=-1)
        reference = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(entropy_from_logits(logits, temperature), reference, rtol=1e-12, atol=1e-12)
    # uniform logits: H = log V = log 11
    assert float(entropy_from_logits(torch.zeros(1, 1, 11, dtype=F64))) == pytest.approx(math.log(11))


def test_token_logprobs_matches_log_softmax_gather():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 9, generator=gen, dtype=F64)
    ids = torch.randint(0, 9, (3, 4), generator=gen)
    for temperature in (1.0, 0.7):
        reference = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
        torch.testing.assert_close(token_logprobs(logits, ids, temperature), reference, rtol=1e-12, atol=1e-12)
    # hand case: logits (0, log 3), T = 1 → p = (1/4, 3/4)
    two = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64)
    assert float(token_logprobs(two, torch.tensor([[1]]), 1.0)) == pytest.approx(math.log(0.75))


# ---------------------------------------------------------------- decoupled PPO, KL-Cov


def test_decoupled_ppo_by_hand():
    # three tokens, A = +1, π_θ = π_prox (u = 1, Lclip = −1), behaviour weights w = π_prox/π_behav
    logp = torch.zeros(1, 3, dtype=F64)
    logp_behav = -torch.tensor([[math.log(0.5), math.log(1.2), math.log(3.0)]], dtype=F64)  # w = .5, 1.2, 3
    mask, adv = torch.ones(1, 3, dtype=F64), torch.tensor([1.0], dtype=F64)
    loss, metrics = decoupled_ppo_loss(logp, logp, logp_behav, adv, mask, eps_low=0.2, eps_high=0.2,
                                       behav_imp_weight_cap=2.0)
    # L = keep · (−1) · w: (−0.5, −1.2, 0) — the w = 3 token is masked (not truncated to 2)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.2, 0.0]], dtype=F64), rtol=1e-12, atol=1e-12)
    # aggregated with the ORIGINAL mask: (−0.5 − 1.2)/3
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(-1.7 / 3)
    assert float(metrics["behav_mask_frac"]) == pytest.approx(1 / 3)
    assert float(metrics["behav_imp_weight"]) == pytest.approx(0.85)  # (0.5 + 1.2)/2


def test_decoupled_ppo_reduces_to_clipped_surrogate_on_policy_and_matches_loop():
    logp, logp_prox, adv, mask = _random_batch(seed=3)
    plain, _ = clipped_surrogate(logp, logp_prox, adv, mask, eps_low=0.2, eps_high=0.2)
    same, _ = decoupled_ppo_loss(logp, logp_prox, logp_prox, adv, mask, eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    logp_behav = logp_prox + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    loss, _ = decoupled_ppo_loss(logp, logp_prox, logp_behav, adv, mask, eps_low=0.2, eps_high=0.2,
                                 behav_imp_weight_cap=1.3)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            w = math.exp(float(logp_prox[i, j] - logp_behav[i, j]))
            keep = mask[i, j] == 1 and w <= 1.3
            assert float(loss[i, j]) == pytest.approx(float(plain[i, j]) * w if keep else 0.0, rel=1e-12, abs=1e-12)


def _kl_cov_loop(logp, logp_old, adv, mask, ratio, coef):
    """Reference in plain Python, following verl's compute_policy_loss_kl_cov."""
    cells = [(i, j) for i in range(logp.shape[0]) for j in range(logp.shape[1]) if mask[i, j] == 1]
    a_mean = sum(float(adv[i]) for i, _ in cells) / len(cells)
    lp_mean = sum(float(logp[i, j]) for i, j in cells) / len(cells)
    cov = {(i, j): (float(adv[i]) - a_mean) * (float(logp[i, j]) - lp_mean) for i, j in cells}
    n_sel = max(1, int(len(cells) * ratio)) if ratio > 0 else 0
    chosen = set(sorted(cells, key=lambda c: -cov[c])[:n_sel])
    out = torch.zeros_like(logp)
    for i, j in cells:
        lr = float(logp[i, j] - logp_old[i, j])
        out[i, j] = -float(adv[i]) * math.exp(lr) + (coef * abs(lr) if (i, j) in chosen else 0.0)
    return out, len(chosen) / len(cells)


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.2, 1.0])
def test_kl_cov_matches_loop_reference(ratio):
    logp, logp_old, adv, mask = _random_batch(seed=5)
    loss, metrics = kl_cov_loss(logp, logp_old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=1.0)
    expected, frac = _kl_cov_loop(logp, logp_old, adv, mask, ratio, 1.0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert float(metrics["kl_cov_frac"]) == pytest.approx(frac)


def test_kl_cov_by_hand():
    # 4 valid tokens, ratio 0.25 → max(1, ⌊4·0.25⌋) = 1 token with the largest cov
    # A = (1, 1, −1, −1) per token (two sequences), logp = (−0.5, −3, −1, −3): Ā = 0, mean logp = −1.875
    # cov = A·(logp + 1.875) = (1.375, −1.125, −0.875, 1.125) → token (0, 0) is the top one
    logp = torch.tensor([[-0.5, -3.0], [-1.0, -3.0]], dtype=F64)
    logp_old = logp - 0.1  # ℓ = 0.1 everywhere, r = e^0.1
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, _ = kl_cov_loss(logp, logp_old, adv, torch.ones(2, 2, dtype=F64), kl_cov_ratio=0.25, ppo_kl_coef=2.0)
    r = math.exp(0.1)
    expected = torch.tensor([[-r + 2.0 * 0.1, -r], [r, r]], dtype=F64)  # + c|ℓ| on the chosen token only
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
