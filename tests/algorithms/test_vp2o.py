import math

import pytest
import torch

from threepo.algorithms.svgd import prototypes
from threepo.algorithms.vp2o import anchor_drift, prototype_drift_fn, shrink_to_anchor_budget

F64 = torch.float64


def test_anchor_drift_hand_case():
    s = 1 / math.sqrt(2)
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [s, s]], dtype=F64)
    anc = torch.tensor([[s, s], [0.0, -1.0], [s, -s]], dtype=F64)
    # cos² = ½ -> Δ = ½;  sign flip -> Δ = 0;  orthogonal -> Δ = 1
    torch.testing.assert_close(anchor_drift(p, anc), torch.tensor([0.5, 0.0, 1.0], dtype=F64))
    with pytest.raises(ValueError, match="p_anchor"):
        anchor_drift(p, anc[:2])


def test_shrink_bisection_hand_case():
    # drift = |x|, budget ½, prev = 0, new = [1, 0.3, 2]; expert 1 is within budget (s = 1)
    # e0: s=½ -> ½ ok; s=¾ -> ¾ no; s=⅝ -> ⅝ no            => s = ½
    # e2: s=½ -> 1 no; s=¼ -> ½ ok; s=⅜ -> ¾ no             => s = ¼
    calls = []

    def drift(blocks):
        calls.append(1)
        return blocks[0].abs().squeeze(1)

    prev = [torch.zeros(3, 1, dtype=F64), torch.zeros(3, 2, dtype=F64)]
    new = [torch.tensor([[1.0], [0.3], [2.0]], dtype=F64), torch.ones(3, 2, dtype=F64)]
    blocks, scale, frac = shrink_to_anchor_budget(prev, new, drift, 0.5, n_bisect=3)
    torch.testing.assert_close(scale, torch.tensor([0.5, 1.0, 0.25], dtype=F64))
    torch.testing.assert_close(blocks[0], torch.tensor([[0.5], [0.3], [0.5]], dtype=F64))
    # every block of an expert moves with the same s
    torch.testing.assert_close(blocks[1], torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.25, 0.25]], dtype=F64))
    assert frac == pytest.approx(2 / 3)
    assert len(calls) == 4  # one check of θ_new plus one per bisection step
    # nothing over budget: θ_new returned as is, one call
    calls.clear()
    blocks, scale, frac = shrink_to_anchor_budget(prev, new, drift, 5.0)
    assert frac == 0.0 and torch.equal(blocks[0], new[0]) and torch.equal(scale, torch.ones(3, dtype=F64)) and len(calls) == 1


def test_shrink_keeps_unclamped_experts_bit_exact_in_bf16():
    prev = [torch.tensor([[0.1], [0.7]], dtype=torch.bfloat16)]
    new = [torch.tensor([[0.3], [5.0]], dtype=torch.bfloat16)]
    blocks, scale, _ = shrink_to_anchor_budget(prev, new, lambda b: b[0].float().abs().squeeze(1), 1.0)
    assert blocks[0][0].item() == new[0][0].item()
    assert scale[1].item() < 1


def test_shrink_on_prototypes_meets_the_budget():
    gen = torch.Generator().manual_seed(0)
    n_exp, hid, inter = 4, 6, 5
    down_prev = torch.randn(n_exp, hid, inter, generator=gen, dtype=F64)
    gate_up_prev = torch.randn(n_exp, 2 * inter, hid, generator=gen, dtype=F64)
    p_anchor, v = prototypes(down_prev, None, n_iter=30, generator=gen)
    # step sizes from none to large: experts 2 and 3 should overshoot a 2.5e-3 budget
    step = torch.tensor([0.0, 1e-3, 0.3, 1.0], dtype=F64)[:, None, None]
    down_new = down_prev + step * torch.randn(n_exp, hid, inter, generator=gen, dtype=F64)
    gate_up_new = gate_up_prev + 0.1
    budget = math.sin(0.05) ** 2
    drift = prototype_drift_fn(p_anchor, v, down_index=1, n_iter=30)
    before = drift([gate_up_new, down_new])
    assert (before[2:] > budget).all() and (before[:2] <= budget).all()
    blocks, scale, frac = shrink_to_anchor_budget([gate_up_prev, down_prev], [gate_up_new, down_new], drift, budget)
    after = drift(blocks)
    assert (after <= budget).all()
    assert frac == 0.5
    assert scale[:2].tolist() == [1.0, 1.0] and (scale[2:] < 1).all()
    assert torch.equal(blocks[1][:2], down_new[:2]) and torch.equal(blocks[0][:2], gate_up_new[:2])
    # bisection keeps the largest tested s: one more eighth would break the budget
    for e in (2, 3):
        s_next = scale.clone()
        s_next[e] += 1 / 8
        probe = [a + s_next[:, None, None] * (b - a) for a, b in zip([gate_up_prev, down_prev], [gate_up_new, down_new])]
        assert drift(probe)[e] > budget or scale[e] == 7 / 8


def test_shrink_validates_blocks():
    with pytest.raises(ValueError, match="theta_prev"):
        shrink_to_anchor_budget([torch.zeros(2, 3)], [torch.zeros(3, 3)], lambda b: torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match="theta_prev"):
        shrink_to_anchor_budget([], [], lambda b: torch.zeros(2), 0.1)
