import math

import pytest
import torch

from threepo.algorithms.advantages import (
    combined_reward,
    dr_grpo_advantages,
    dynamic_filter,
    grpo_advantages,
    lampo_advantages,
    sequence_logprob,
    zero_advantage_groups,
)

F64 = torch.float64


def _lampo_loop(rewards, seq_logp, tau):
    b, g = rewards.shape
    out = torch.zeros(b, g, dtype=F64)
    for bi in range(b):
        for i in range(g):
            acc = 0.0
            for j in range(g):
                if j != i:
                    w = 1.0 / (1.0 + math.exp(-(seq_logp[bi, i] - seq_logp[bi, j]).item() / tau))
                    acc += (rewards[bi, i] - rewards[bi, j]).item() * w
            out[bi, i] = acc / (g - 1)
    return out


def test_grpo_hand_case():
    # R = [1, 0, 0, 1]: mean 0.5; unbiased var = 4·0.25/3 = 1/3, std = 0.57735
    # A = ±0.5 / (0.57735 + 1e-6) = ±0.866024
    a = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(a, torch.tensor([[expected, -expected, -expected, expected]], dtype=F64))


def test_grpo_sums_to_zero_per_group_and_unit_std():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(7, 8, generator=gen, dtype=F64)
    a = grpo_advantages(r, eps=0.0)
    torch.testing.assert_close(a.sum(dim=1), torch.zeros(7, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(a.std(dim=1), torch.ones(7, dtype=F64))


def test_grpo_equal_rewards_and_singleton_groups_give_zero():
    assert torch.equal(grpo_advantages(torch.full((2, 4), 0.7, dtype=F64)), torch.zeros(2, 4, dtype=F64))
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]], dtype=F64)), torch.zeros(2, 1, dtype=F64))


def test_dr_grpo_is_mean_centred_only():
    # R = [3, 1, 2]: mean 2 -> [1, -1, 0]
    a = dr_grpo_advantages(torch.tensor([[3.0, 1.0, 2.0]], dtype=F64))
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0, 0.0]], dtype=F64))


def test_lampo_hand_case():
    # G = 2, R = [1, 0], s = [0, 0]: σ(0) = ½, A_0 = (1 − 0)·½ / 1 = 0.5, A_1 = −0.5
    a = lampo_advantages(torch.tensor([[1.0, 0.0]], dtype=F64), torch.zeros(1, 2, dtype=F64))
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5]], dtype=F64))
    # s = [log 3 · τ, 0] with τ = 1: σ(log 3) = 3/4, σ(−log 3) = 1/4 -> A = [0.75, −0.25]; not zero-mean
    s = torch.tensor([[math.log(3.0), 0.0]], dtype=F64)
    a = lampo_advantages(torch.tensor([[1.0, 0.0]], dtype=F64), s, tau=1.0)
    torch.testing.assert_close(a, torch.tensor([[0.75, -0.25]], dtype=F64))


def test_lampo_matches_loop():
    gen = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (5, 6), generator=gen).to(F64) + 0.1 * torch.rand(5, 6, generator=gen, dtype=F64)
    s = -10 * torch.rand(5, 6, generator=gen, dtype=F64)
    torch.testing.assert_close(lampo_advantages(r, s, tau=1.5), _lampo_loop(r, s, 1.5))


def test_lampo_large_tau_is_scaled_dr_grpo():
    gen = torch.Generator().manual_seed(2)
    r = torch.rand(4, 8, generator=gen, dtype=F64)
    s = torch.randn(4, 8, generator=gen, dtype=F64)
    g = r.shape[1]
    limit = 0.5 * g / (g - 1) * dr_grpo_advantages(r)
    torch.testing.assert_close(lampo_advantages(r, s, tau=1e9), limit, atol=1e-8, rtol=0)
    # at moderate τ it must still differ (the weights matter)
    assert (lampo_advantages(r, s, tau=1.5) - limit).abs().max() > 1e-3


def test_lampo_sum_formula_and_degenerate_cases():
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(3, 5, generator=gen, dtype=F64)
    s = torch.randn(3, 5, generator=gen, dtype=F64)
    tau = 0.7
    # Σ_i A_i = 1/(G−1) Σ_{i<j} (R_i − R_j) tanh((s_i − s_j)/(2τ))   (§4.1)
    d_r = r[:, :, None] - r[:, None, :]
    t = torch.tanh((s[:, :, None] - s[:, None, :]) / (2 * tau))
    expected = torch.triu(d_r * t, diagonal=1).sum(dim=(1, 2)) / 4
    torch.testing.assert_close(lampo_advantages(r, s, tau=tau).sum(dim=1), expected)
    assert torch.equal(lampo_advantages(torch.ones(2, 1, dtype=F64), torch.zeros(2, 1, dtype=F64)), torch.zeros(2, 1, dtype=F64))
    assert torch.equal(lampo_advantages(torch.ones(2, 4, dtype=F64), s[:2, :4]), torch.zeros(2, 4, dtype=F64))
    with pytest.raises(ValueError, match="seq_logp"):
        lampo_advantages(r, s[:, :4])
    with pytest.raises(ValueError, match="tau"):
        lampo_advantages(r, s, tau=0.0)


def test_sequence_logprob_sum_and_mean():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0], [-3.0, -3.0, -3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # sums: −1 −2 = −3; −0.5; empty -> 0.  means: −3/2 = −1.5; −0.5; empty -> 0
    torch.testing.assert_close(sequence_logprob(logp, mask, "sum"), torch.tensor([-3.0, -0.5, 0.0], dtype=F64))
    torch.testing.assert_close(sequence_logprob(logp, mask.bool(), "mean"), torch.tensor([-1.5, -0.5, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="mode"):
        sequence_logprob(logp, mask, "max")


def test_zero_advantage_groups_and_dynamic_filter():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert zero_advantage_groups(r).tolist() == [True, False, True]
    assert dynamic_filter(r).tolist() == [False, True, False]
    dead = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    assert dynamic_filter(dead).tolist() == [False, False]
    assert dynamic_filter(dead, keep_all_if_empty=True).tolist() == [True, True]
    # the fallback only triggers when everything is filtered
    assert dynamic_filter(r, keep_all_if_empty=True).tolist() == [False, True, False]


def test_combined_reward():
    # R = R_ext + 0.1·R_sem: [1 + 0.05, 0 + 0.09]
    r = combined_reward(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0.5, 0.9], dtype=F64), 0.1)
    torch.testing.assert_close(r, torch.tensor([1.05, 0.09], dtype=F64))
    with pytest.raises(ValueError, match="r_sem"):
        combined_reward(torch.zeros(2), torch.zeros(3), 0.1)
    # λ_sem breaks an all-correct tie, so the group is no longer dead
    r = combined_reward(torch.ones(1, 2, dtype=F64), torch.tensor([[0.2, 0.4]], dtype=F64), 0.1)
    assert not zero_advantage_groups(r).item()


def test_rescued_groups_hand_cases():
    from threepo.algorithms.advantages import rescued_groups

    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0],   # slot 0 all 1, slot 1 all 0: mixed only across slots
                            [1.0, 0.0, 1.0, 0.0],   # every slot mixed on its own: not rescued
                            [1.0, 1.0, 1.0, 1.0],   # dead group: not rescued
                            [1.0, 0.0, 0.0, 0.0]],  # slot 0 mixed, slot 1 uniform: rescued
                           dtype=torch.float64)
    slots = torch.tensor([[0, 0, 1, 1]] * 4)
    assert rescued_groups(rewards, slots).tolist() == [True, False, False, True]
    # one slot (GRPO, B3PO): a mixed group is never "rescued"
    assert not rescued_groups(rewards, torch.zeros_like(slots)).any()
