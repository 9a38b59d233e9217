import math

import pytest
import torch

from threepo.algorithms.svgd import (
    angular_kernel,
    attract_expert_grads,
    kernel_matrix,
    median_bandwidth,
    prototypes,
    repulsion_energy,
)

F64 = torch.float64


def _with_spectrum(gen, n_exp, hid, inter, spectrum):
    """down_proj [E, H, I] whose experts have singular values `spectrum`; returns (W, U)."""
    mats, lefts = [], []
    for _ in range(n_exp):
        u, _ = torch.linalg.qr(torch.randn(hid, hid, generator=gen, dtype=F64))
        v, _ = torch.linalg.qr(torch.randn(inter, inter, generator=gen, dtype=F64))
        k = len(spectrum)
        mats.append(u[:, :k] @ torch.diag(torch.tensor(spectrum, dtype=F64)) @ v[:, :k].T)
        lefts.append(u[:, 0])
    return torch.stack(mats), torch.stack(lefts)


def _three_prototypes():
    # p0 = e1, p1 = (e1 + e2)/√2, p2 = e2:  c01 = c12 = ½, c02 = 0
    s = 1 / math.sqrt(2)
    return torch.tensor([[1.0, 0.0], [s, s], [0.0, 1.0]], dtype=F64)


def test_prototypes_match_svd_top_left_vector():
    gen = torch.Generator().manual_seed(0)
    w, _ = _with_spectrum(gen, 3, 8, 6, [10.0, 1.0, 0.5, 0.1])
    p, v = prototypes(w, None, n_iter=2, generator=gen)
    u1 = torch.linalg.svd(w).U[:, :, 0]  # [E, H]
    assert p.shape == (3, 8) and v.shape == (3, 6)
    torch.testing.assert_close(p.norm(dim=1), torch.ones(3, dtype=F64))
    # equal up to sign: |⟨p, u1⟩| = 1
    torch.testing.assert_close((p * u1).sum(dim=1).abs(), torch.ones(3, dtype=F64), atol=1e-7, rtol=0)


def test_prototypes_warm_start_converges_on_a_close_spectrum():
    gen = torch.Generator().manual_seed(1)
    w, u1 = _with_spectrum(gen, 2, 6, 5, [1.0, 0.9, 0.3])
    p, v = prototypes(w, None, n_iter=1, generator=gen)
    first = (p * u1).sum(dim=1).abs()
    for _ in range(100):
        p, v = prototypes(w, v, n_iter=1)
    last = (p * u1).sum(dim=1).abs()
    # ratio (0.9)² per iteration: 100 warm iterations take it to 1, one cold one does not
    torch.testing.assert_close(last, torch.ones(2, dtype=F64), atol=1e-8, rtol=0)
    assert (first < 1 - 1e-4).any()


def test_prototype_gradient_is_the_stop_grad_surrogate():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 4, 3, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, generator=gen, dtype=F64)
    # with n_iter = 0 the forward is exactly p = W v / ‖W v‖, so autograd must match finite differences
    assert torch.autograd.gradcheck(lambda x: prototypes(x, v, n_iter=0)[0], (w,))
    p, _ = prototypes(w, v, n_iter=3)
    p.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_prototypes_validate_inputs():
    with pytest.raises(ValueError, match="generator"):
        prototypes(torch.zeros(2, 3, 4), None)
    with pytest.raises(ValueError, match="down_proj"):
        prototypes(torch.zeros(3, 4), None)
    with pytest.raises(ValueError, match="v_prev"):
        prototypes(torch.zeros(2, 3, 4), torch.zeros(2, 3))


def test_angular_kernel_hand_case():
    p = _three_prototypes()
    kern, h = angular_kernel(p)
    # 1 − c: [½, 1, ½] -> median ½; h = ½ / log 4.  k01 = exp(−½ / h) = exp(−log 4) = ¼, k02 = 1/16
    assert h == pytest.approx(0.5 / math.log(4))
    torch.testing.assert_close(kernel_matrix(p, h), kern)
    with pytest.raises(ValueError, match="bandwidth"):
        kernel_matrix(p, 0.0)
    expected = torch.tensor([[1, 0.25, 1 / 16], [0.25, 1, 0.25], [1 / 16, 0.25, 1]], dtype=F64)
    torch.testing.assert_close(kern, expected)


def test_angular_kernel_symmetric_unit_diagonal_sign_invariant():
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.functional.normalize(torch.randn(6, 5, generator=gen, dtype=F64), dim=1)
    kern, h = angular_kernel(p)
    torch.testing.assert_close(kern, kern.T)
    assert torch.equal(kern.diagonal(), torch.ones(6, dtype=F64))
    assert ((kern > 0) & (kern <= 1)).all()
    flipped = p * torch.tensor([1, -1, 1, -1, -1, 1], dtype=F64)[:, None]
    torch.testing.assert_close(angular_kernel(flipped)[0], kern)
    assert angular_kernel(p[:1])[1] == 1e-4  # one expert: no pairs, bandwidth = h_min
    # identical prototypes -> median 0 -> h_min
    assert median_bandwidth(torch.ones(3, 2, dtype=F64) / math.sqrt(2), h_min=1e-3) == 1e-3


def _attract_loop(grads, kern, attract, alpha):
    out = torch.empty_like(grads)
    for i in range(grads.shape[0]):
        num, den = torch.zeros_like(grads[i]), 0.0
        for j in range(grads.shape[0]):
            if j == i or attract[i, j]:
                k = 1.0 if j == i else kern[i, j].item()
                num += k * grads[j]
                den += k
        out[i] = (1 - alpha) * grads[i] + alpha * num / den
    return out


def test_attraction_hand_case():
    kern = angular_kernel(_three_prototypes())[0]
    attract = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    grads = torch.tensor([[1.0], [3.0], [5.0]], dtype=F64)
    # α = 1: G̃0 = (1·1 + ¼·3)/(1 + ¼) = 1.4; G̃1 = (¼·1 + 1·3)/1.25 = 2.6; G̃2 = 5 (A(2) = ∅)
    torch.testing.assert_close(attract_expert_grads(grads, kern, attract, alpha_att=1.0), torch.tensor([[1.4], [2.6], [5.0]], dtype=F64))
    # α = ½: G̃0 = ½·1 + ½·1.4 = 1.2
    assert attract_expert_grads(grads, kern, attract, alpha_att=0.5)[0, 0].item() == pytest.approx(1.2)


def test_attraction_matches_loop_and_reduces_correctly():
    gen = torch.Generator().manual_seed(4)
    p = torch.nn.functional.normalize(torch.randn(5, 4, generator=gen, dtype=F64), dim=1)
    kern = angular_kernel(p)[0]
    attract = torch.rand(5, 5, generator=gen) > 0.5
    attract = attract | attract.T
    grads = torch.randn(5, 3, 2, generator=gen, dtype=F64)
    for alpha in (0.0, 0.3, 1.0):
        torch.testing.assert_close(attract_expert_grads(grads, kern, attract, alpha_att=alpha), _attract_loop(grads, kern, attract, alpha))
    # α = 0 is the identity; one particle (E = 1) is the plain gradient whatever α
    assert torch.equal(attract_expert_grads(grads, kern, attract, alpha_att=0.0), grads)
    one = grads[:1]
    torch.testing.assert_close(attract_expert_grads(one, torch.ones(1, 1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)), one)
    # inputs untouched, dtype kept
    before = grads.clone()
    attract_expert_grads(grads, kern, attract, alpha_att=1.0)
    assert torch.equal(grads, before)
    bf = grads.to(torch.bfloat16)
    assert attract_expert_grads(bf, kern, attract).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="alpha_att"):
        attract_expert_grads(grads, kern, attract, alpha_att=1.5)


def test_repulsion_hand_value_and_empty_set():
    p = _three_prototypes()
    h = 0.5 / math.log(4)
    repel = torch.zeros(3, 3, dtype=torch.bool)
    repel[0, 2] = repel[2, 0] = True
    # P_R = {(0, 2)}: L_rep = k02 = 1/16
    assert repulsion_energy(p, h, repel).item() == pytest.approx(1 / 16)
    # pairs (0,1) and (0,2): mean(¼, 1/16) = 5/32
    repel[0, 1] = repel[1, 0] = True
    assert repulsion_energy(p, h, repel).item() == pytest.approx(5 / 32)
    x = p.clone().requires_grad_(True)
    empty = repulsion_energy(x, h, torch.zeros(3, 3, dtype=torch.bool))
    empty.backward()
    assert empty.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


def _angle(p):
    return math.acos(min(1.0, abs((p[0] * p[1]).sum().item())))


def test_repulsion_descent_through_down_proj_increases_the_angle():
    gen = torch.Generator().manual_seed(5)
    w, _ = _with_spectrum(gen, 1, 4, 3, [3.0, 0.5, 0.1])
    # expert 1 = expert 0 rotated a little in output space: prototypes 0.2 rad apart
    rot = torch.eye(4, dtype=F64)
    rot[:2, :2] = torch.tensor([[math.cos(0.2), -math.sin(0.2)], [math.sin(0.2), math.cos(0.2)]], dtype=F64)
    down = torch.stack([w[0], rot @ w[0]]).requires_grad_(True)
    p, v = prototypes(down, None, n_iter=20, generator=gen)
    before = _angle(p.detach())
    energy = repulsion_energy(p, 0.1, torch.tensor([[False, True], [True, False]]))
    energy.backward()
    assert down.grad.abs().sum() > 0
    with torch.no_grad():
        stepped = down - 0.05 * down.grad
    after = _angle(prototypes(stepped, v, n_iter=20)[0])
    assert after > before + 1e-3
