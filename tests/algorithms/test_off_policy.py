"""Importance weights and off-policy diagnostics (algorithms.md §5.6, §5.7), in float64."""

from __future__ import annotations

import math

import pytest
import torch

from threepo.algorithms.losses import aggregate_loss
from threepo.algorithms.off_policy import (
    behaviour_drift,
    capped_fraction,
    correction_weights,
    kish_ess_fraction,
    kl_k1,
    kl_k3,
    offpolicy_diagnostics,
    seq_is_weights,
    seq_mis_weights,
    token_is_weights,
    token_mis_weights,
)

F64 = torch.float64
LN = math.log


def _pair(ratios, mask):
    """logp, logp_behav with per-token ratios π/μ = `ratios` (logp_behav = 0)."""
    logp = torch.tensor(ratios, dtype=F64).log()
    return logp, torch.zeros_like(logp), torch.tensor(mask, dtype=F64)


def test_token_is_weights_by_hand():
    # ρ = (0.5, 1.5, 3, pad) with C = 2 → (0.5, 1.5, 2, 0)
    logp, behav, mask = _pair([[0.5, 1.5, 3.0, 7.0]], [[1, 1, 1, 0]])
    logp.requires_grad_(True)
    w = token_is_weights(logp, behav, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    assert not w.requires_grad
    # clamp: ℓ = 50 → e^20 (cap out of the way)
    w = token_is_weights(torch.full((1, 1), 50.0, dtype=F64), torch.zeros(1, 1, dtype=F64),
                         torch.ones(1, 1, dtype=F64), cap=1e30)
    assert float(w) == pytest.approx(math.exp(20.0))


def test_seq_is_weights_by_hand():
    # seq 0: 2 · 0.75 = 1.5 (padding ρ = 100 ignored) ; seq 1: 2 · 2 = 4 → C = 2
    logp, behav, mask = _pair([[2.0, 0.75, 100.0], [2.0, 2.0, 1.0]], [[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(seq_is_weights(logp, behav, mask, cap=2.0), torch.tensor([1.5, 2.0], dtype=F64))


def test_token_mis_weights_by_hand_removes_rejected_from_denominator():
    logp, behav, mask = _pair([[0.5, 3.0, 1.0]], [[1, 1, 1]])
    w, keep = token_mis_weights(logp, behav, mask, cap=2.0)
    # ρ = 3 > 2 is rejected (masked), not truncated
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.0, 1.0]], dtype=F64))
    assert keep.tolist() == [[True, False, True]]
    # token-mean of a unit loss · w over `keep`: (0.5 + 1)/2, the rejected token leaves the denominator
    assert float(aggregate_loss(w, keep, "token-mean")) == pytest.approx(0.75)


def test_seq_mis_weights_by_hand():
    # seq 0: Πρ = 1.5 kept ; seq 1: Πρ = 4 > 2 rejected ; padding stays out
    logp, behav, mask = _pair([[2.0, 0.75, 100.0], [2.0, 2.0, 1.0]], [[1, 1, 0], [1, 1, 1]])
    w, keep = seq_mis_weights(logp, behav, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.5, 0.0], dtype=F64))
    assert keep.tolist() == [[True, True, False], [False, False, False]]
    # the rejected sequence leaves N in a sequence-mean: ones · w over keep → (1.5 + 1.5)/1
    loss = torch.ones(2, 3, dtype=F64) * w[:, None]
    assert float(aggregate_loss(loss, keep, "seq-mean-token-sum")) == pytest.approx(3.0)


def test_invalid_cap_raises():
    logp, behav, mask = _pair([[1.0]], [[1]])
    with pytest.raises(ValueError, match="cap"):
        token_is_weights(logp, behav, mask, cap=0.0)


def test_kish_ess_fraction_by_hand():
    # w = (1, 2, 3): (Σw)² / (N Σw²) = 36 / (3 · 14) = 6/7
    assert float(kish_ess_fraction(torch.tensor([1.0, 2.0, 3.0], dtype=F64).log())) == pytest.approx(6 / 7, rel=1e-12)
    # equal weights → 1, even for huge log-weights (no overflow in log space)
    assert float(kish_ess_fraction(torch.full((5,), 1000.0, dtype=F64))) == pytest.approx(1.0, rel=1e-12)
    # one dominant weight among 4 → 1/4
    assert float(kish_ess_fraction(torch.tensor([0.0, -60.0, -60.0, -60.0], dtype=F64))) == pytest.approx(0.25)


def test_kish_ess_fraction_matches_direct_formula():
    gen = torch.Generator().manual_seed(0)
    log_w = torch.randn(50, generator=gen, dtype=F64) * 2
    w = log_w.exp()
    direct = w.sum() ** 2 / (w.numel() * (w**2).sum())
    torch.testing.assert_close(kish_ess_fraction(log_w), direct, rtol=1e-12, atol=0)


def test_kl_estimates_by_hand():
    # ℓ = (ln 2, −ln 2): k1 = mean(−ℓ) = 0 ; k3 = mean(2 − ln 2 − 1, ½ + ln 2 − 1) = ½ · ½ = 0.25
    logp, behav, mask = _pair([[2.0, 0.5, 9.0]], [[1, 1, 0]])
    assert float(kl_k1(logp, behav, mask)) == pytest.approx(0.0, abs=1e-15)
    assert float(kl_k3(logp, behav, mask)) == pytest.approx(0.25, rel=1e-12)


def test_kl_k3_is_nonnegative_and_estimates_kl():
    # tokens from μ: E_μ[e^ℓ − ℓ − 1] = KL(μ ‖ π) with ℓ = log π − log μ
    gen = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.6, 0.3, 0.1], dtype=F64)
    pi = torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    tokens = torch.multinomial(mu, 200_000, replacement=True, generator=gen)[None]
    logp, behav, mask = pi.log()[tokens], mu.log()[tokens], torch.ones(tokens.shape, dtype=F64)
    exact = float((mu * (mu / pi).log()).sum())
    assert float(kl_k3(logp, behav, mask)) == pytest.approx(exact, rel=0.02)
    assert float(kl_k1(logp, behav, mask)) == pytest.approx(exact, rel=0.02)
    noisy = torch.randn(4, 6, generator=gen, dtype=F64) * 5
    assert float(kl_k3(noisy, torch.zeros_like(noisy), torch.ones_like(noisy))) >= 0


def _diagnostics_loop(logp, behav, mask, cap):
    toks, seqs, lengths = [], [], []
    for i in range(logp.shape[0]):
        row = [float(logp[i, j] - behav[i, j]) for j in range(logp.shape[1]) if mask[i, j] == 1]
        toks += row
        if row:
            seqs.append(max(-20.0, min(20.0, sum(row))))
            lengths.append(len(row))
    ws = [math.exp(s) for s in seqs]
    # verl: clamp to [1/C, C], broadcast to tokens, normalise to token-mean 1, ESS = 1/mean(w̃²)
    per_token = [min(max(w, 1 / cap), cap) for w, n in zip(ws, lengths) for _ in range(n)]
    norm = [w / (sum(per_token) / len(per_token)) for w in per_token]
    return {
        "kl": sum(-x for x in toks) / len(toks),
        "k3_kl": sum(math.exp(x) - x - 1 for x in toks) / len(toks),
        "ess_frac": sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws)),
        "ess_frac_verl": 1 / (sum(w * w for w in norm) / len(norm)),
        "frac_truncated_token": sum(math.exp(x) > cap for x in toks) / len(toks),
        "frac_truncated_seq": sum(w > cap for w in ws) / len(ws),
        "chi2_token": sum(math.exp(2 * x) for x in toks) / len(toks) - 1,
        "chi2_seq": sum(w * w for w in ws) / len(ws) - 1,
    }


def test_offpolicy_diagnostics_matches_loop_reference():
    gen = torch.Generator().manual_seed(2)
    logp = -torch.rand(6, 8, generator=gen, dtype=F64) * 2
    behav = logp + 0.2 * torch.randn(6, 8, generator=gen, dtype=F64)
    mask = (torch.rand(6, 8, generator=gen) < 0.75).to(F64)
    mask[5] = 0  # a sequence without valid tokens is left out
    got = offpolicy_diagnostics(logp.float(), behav.float(), mask, cap=1.5)
    expected = _diagnostics_loop(logp.float().double(), behav.float().double(), mask, 1.5)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_offpolicy_diagnostics_on_policy():
    logp = -torch.rand(3, 4, dtype=F64)
    got = offpolicy_diagnostics(logp, logp.clone(), torch.ones(3, 4), cap=2.0)
    assert got == {"kl": 0.0, "k3_kl": 0.0, "ess_frac": 1.0, "ess_frac_verl": 1.0, "frac_truncated_token": 0.0,
                   "frac_truncated_seq": 0.0, "chi2_token": 0.0, "chi2_seq": 0.0}
    with pytest.raises(ValueError, match="valid token"):
        offpolicy_diagnostics(logp, logp, torch.zeros(3, 4), cap=2.0)


def test_kl_k3_is_never_negative_on_policy():
    # identical log-probs up to fp32 rounding: e^ℓ − ℓ − 1 would round below zero for some ℓ ~ 1e-7
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 32, generator=gen)
    noisy = logp + torch.randn(64, 32, generator=gen) * 1e-7
    mask = torch.ones(64, 32)
    value = kl_k3(noisy, logp, mask)
    assert 0.0 <= float(value) < 1e-12


def test_behaviour_drift_by_hand():
    # ℓ = logp − logp_behav: seq 1 (ln 2, 0), seq 2 (0, pad), seq 3 all padding (left out of the ESS)
    logp = torch.tensor([[LN(2.0), 0.0], [0.0, 9.0], [5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
    out = behaviour_drift(logp, torch.zeros_like(logp), mask)
    # k3 per valid token: e^ℓ − ℓ − 1 = 1 − ln 2, 0, 0 over 3 tokens
    assert float(out["kl_k3"]) == pytest.approx((1.0 - LN(2.0)) / 3, rel=1e-12)
    # sequence weights 2, 1: Kish ESS / N = (2 + 1)² / (2 · (4 + 1)) = 0.9
    assert float(out["ess_frac"]) == pytest.approx(0.9, rel=1e-12)
    same = behaviour_drift(logp, logp, mask)
    assert float(same["kl_k3"]) == 0.0 and float(same["ess_frac"]) == pytest.approx(1.0, rel=1e-12)


def test_correction_weights_of_each_kind_by_hand():
    # ρ per token: seq 1 (2, 2) → Π = 4 > C = 3; seq 2 (0.5, pad) → Π = 0.5
    logp, behav, mask = _pair([[2.0, 2.0], [0.5, 1.0]], [[1, 1], [1, 0]])
    w, m = correction_weights("none", logp, behav, mask, cap=3.0)
    assert torch.equal(w, mask) and torch.equal(m, mask)
    w, m = correction_weights("token_tis", logp, behav, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.5, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    w, m = correction_weights("seq_tis", logp, behav, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 3.0], [0.5, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    w, m = correction_weights("seq_mis", logp, behav, mask, cap=3.0)  # seq 1 rejected, mask too
    assert w.shape == m.shape == mask.shape
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [0.5, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(m, torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64))
    w, m = correction_weights("token_mis", logp, behav, mask, cap=1.5)  # the ρ = 2 tokens rejected
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [0.5, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(m, torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="kind"):
        correction_weights("tis", logp, behav, mask, cap=3.0)


def test_capped_fraction_counts_what_each_correction_truncates_or_rejects():
    # tokens ρ = (0.5, 1.5, 3 | 3, pad): C = 2 caps 2 of the 4 valid tokens; sequence products 2.25 and 3
    logp, behav, mask = _pair([[0.5, 1.5, 3.0], [3.0, 7.0, 1.0]], [[1, 1, 1], [1, 0, 0]])
    for kind in ("token_tis", "token_mis"):
        assert float(capped_fraction(kind, logp, behav, mask, cap=2.0)) == pytest.approx(2 / 4)
    for kind in ("seq_tis", "seq_mis"):
        assert float(capped_fraction(kind, logp, behav, mask, cap=2.0)) == pytest.approx(2 / 2)
        assert float(capped_fraction(kind, logp, behav, mask, cap=2.5)) == pytest.approx(1 / 2)
    assert float(capped_fraction("none", logp, behav, mask, cap=2.0)) == 0.0
    assert float(capped_fraction("token_tis", behav, behav, mask, cap=2.0)) == 0.0  # on-policy: nothing capped
