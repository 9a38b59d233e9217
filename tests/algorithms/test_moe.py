import pytest
import torch
import torch.nn.functional as F

from threepo.algorithms.moe import (
    chance_lift,
    coactivation_sets,
    coactivation_stats,
    expert_orthogonality_loss,
    expert_outputs,
    routing_diversification_loss,
    update_coactivation_ema,
)

F64 = torch.float64


def _stats_loop(topk_idx, n_exp, mask):
    f = torch.zeros(n_exp)
    c = torch.zeros(n_exp, n_exp)
    n = 0
    for t in range(topk_idx.shape[0]):
        if mask is not None and not mask[t]:
            continue
        n += 1
        chosen = set(topk_idx[t].tolist())
        for i in chosen:
            f[i] += 1
            for j in chosen:
                c[i, j] += 1
    return f / n, c / n


def test_coactivation_stats_hand_case():
    # S_0 = {0,1}, S_1 = {0,2}, S_2 = {1,2} (masked out)  ->  T = 2
    idx = torch.tensor([[0, 1], [2, 0], [1, 2]])
    f, c = coactivation_stats(idx, 4, torch.tensor([True, True, False]))
    torch.testing.assert_close(f, torch.tensor([1.0, 0.5, 0.5, 0.0]))
    expected = torch.tensor([[1.0, 0.5, 0.5, 0], [0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(c, expected)


def test_coactivation_stats_match_loop():
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(50)])
    mask = torch.rand(50, generator=gen) > 0.3
    for m in (None, mask):
        f, c = coactivation_stats(idx, 8, m)
        f_ref, c_ref = _stats_loop(idx, 8, m)
        torch.testing.assert_close(f, f_ref)
        torch.testing.assert_close(c, c_ref)
        torch.testing.assert_close(c.diagonal(), f)  # C_ii = f_i
        torch.testing.assert_close(f.sum(), torch.tensor(3.0))  # K experts per token
    with pytest.raises(ValueError, match="topk_idx"):
        coactivation_stats(idx, 5)
    with pytest.raises(ValueError, match="mask"):
        coactivation_stats(idx, 8, torch.zeros(50, dtype=torch.bool))


def test_ema_update():
    f0, c0 = torch.tensor([1.0, 0.0]), torch.eye(2)
    f1, c1 = torch.tensor([0.0, 1.0]), torch.zeros(2, 2)
    first = update_coactivation_ema(None, None, f0, c0, 0.9)
    assert torch.equal(first[0], f0) and torch.equal(first[1], c0)
    # 0.9·[1, 0] + 0.1·[0, 1] = [0.9, 0.1];  0.9·I + 0.1·0 = 0.9·I
    f_hat, c_hat = update_coactivation_ema(*first, f1, c1, 0.9)
    torch.testing.assert_close(f_hat, torch.tensor([0.9, 0.1]))
    torch.testing.assert_close(c_hat, 0.9 * torch.eye(2))
    with pytest.raises(ValueError, match="beta"):
        update_coactivation_ema(f0, c0, f1, c1, 1.0)


def test_coactivation_sets_hand_case():
    # 4 experts, f = [0.4, 0.4, 0.4, 0], f_i f_j = 0.16; C01 = 0.4 -> lift 2.5 (attract);
    # C02 = 0.06 -> lift 0.375 (repel); C12 = 0.16 -> lift 1 (neutral);
    # expert 3 inactive -> repelled by and repelling everyone
    f = torch.tensor([0.4, 0.4, 0.4, 0.0], dtype=F64)
    c = torch.tensor([[0.4, 0.4, 0.06, 0], [0.4, 0.4, 0.16, 0], [0.06, 0.16, 0.4, 0], [0, 0, 0, 0]], dtype=F64)
    attract, repel = coactivation_sets(f, c, lift_hi=2.0, lift_lo=0.5)
    assert attract.nonzero().tolist() == [[0, 1], [1, 0]]
    assert repel.nonzero().tolist() == [[0, 2], [0, 3], [1, 3], [2, 0], [2, 3], [3, 0], [3, 1], [3, 2]]
    assert not attract.diagonal().any() and not repel.diagonal().any()
    assert not (attract & repel).any()
    with pytest.raises(ValueError, match="lift_lo"):
        coactivation_sets(f, c, lift_hi=0.5, lift_lo=0.5)


def test_chance_lift_and_thresholds_relative_to_a_uniform_top_k_router():
    # top-2 of 4: f = 1/2, C_ij = 2·1/(4·3) = 1/6, lift = (1/6)/(1/4) = 2/3 = 4·1/(2·3)
    assert chance_lift(4, 2) == pytest.approx(2 / 3) and chance_lift(8, 2) == pytest.approx(8 / 14)
    assert chance_lift(4, 1) == 0.0 and chance_lift(4, 4) == 1.0
    uniform_f, uniform_c = torch.full((4,), 0.5, dtype=F64), torch.full((4, 4), 1 / 6, dtype=F64).fill_diagonal_(0.5)
    attract, repel = coactivation_sets(uniform_f, uniform_c, lift_hi=1.25, lift_lo=0.5, top_k=2)
    assert not attract.any() and not repel.any()  # relative lift 1: neutral
    # pairs {0,1} and {2,3}, half the tokens each: C01 = 1/2 -> raw lift 2 (never >= 2.0 + ε), relative 3
    paired_c = torch.tensor([[.5, .5, 0, 0], [.5, .5, 0, 0], [0, 0, .5, .5], [0, 0, .5, .5]], dtype=F64)
    raw_attract, _ = coactivation_sets(uniform_f, paired_c, lift_hi=2.5, lift_lo=0.5)
    attract, repel = coactivation_sets(uniform_f, paired_c, lift_hi=2.5, lift_lo=0.5, top_k=2)
    assert not raw_attract.any() and attract.nonzero().tolist() == [[0, 1], [1, 0], [2, 3], [3, 2]]
    assert repel.sum() == 8  # every cross pair never co-occurs
    one_f, one_c = torch.full((4,), 0.25, dtype=F64), torch.diag(torch.full((4,), 0.25, dtype=F64))
    attract, repel = coactivation_sets(one_f, one_c, top_k=1)  # top-1: nothing can co-activate
    assert not attract.any() and repel.sum() == 12
    with pytest.raises(ValueError, match="top_k"):
        chance_lift(4, 5)


def test_expert_outputs_match_per_token_loop():
    gen = torch.Generator().manual_seed(1)
    n_exp, hid, inter, n_tok = 4, 5, 3, 6
    gate_up = torch.randn(n_exp, 2 * inter, hid, generator=gen, dtype=F64)
    down = torch.randn(n_exp, hid, inter, generator=gen, dtype=F64)
    x = torch.randn(n_tok, hid, generator=gen, dtype=F64)
    idx = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(n_tok)])
    y = expert_outputs(x, gate_up, down, idx)
    for t in range(n_tok):
        for k in range(2):
            e = idx[t, k]
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            torch.testing.assert_close(y[t, k], down[e] @ (F.silu(gate) * up))


def test_orthogonality_loss_orthogonal_parallel_and_hand_case():
    eye = torch.eye(3, dtype=F64)
    orth = torch.stack([eye, 2 * eye])  # T=2, K=3, outputs mutually orthogonal
    assert expert_orthogonality_loss(orth).item() == pytest.approx(0.0, abs=1e-12)
    par = torch.tensor([[[1.0, 2.0], [2.0, 4.0], [-3.0, -6.0]]], dtype=F64)  # all parallel / anti-parallel
    assert expert_orthogonality_loss(par).item() == pytest.approx(1.0, abs=1e-5)
    # T=1, K=2, y = (1,0), (1,1): cos² = ½ for both ordered pairs -> (½ + ½)/(1·2·1) = ½
    half = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]], dtype=F64)
    assert expert_orthogonality_loss(half).item() == pytest.approx(0.5, abs=1e-5)
    # the mask averages over valid tokens only
    both = torch.cat([half, orth[:1, :2, :2]])
    assert expert_orthogonality_loss(both, torch.tensor([True, False])).item() == pytest.approx(0.5, abs=1e-5)
    assert expert_orthogonality_loss(both).item() == pytest.approx(0.25, abs=1e-5)
    assert expert_orthogonality_loss(torch.ones(3, 1, 4)).item() == 0.0  # K = 1


def test_routing_diversification_loss():
    # constant routing: no variance -> 0
    const = torch.full((4, 3), 1 / 3, dtype=F64)
    assert routing_diversification_loss(const).item() == pytest.approx(0.0)
    # two tokens, probs [1,0] and [0,1]: Var per expert = ¼ -> L_div = −¼
    sharp = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=F64)
    assert routing_diversification_loss(sharp, torch.tensor([1, 1, 0])).item() == pytest.approx(-0.25)
    # all three tokens: means ½, Var = (¼ + ¼ + 0)/3 = 1/6
    assert routing_diversification_loss(sharp).item() == pytest.approx(-1 / 6)
    # descent increases the variance of routing across tokens
    logits = torch.tensor([[0.1, 0.0], [0.0, 0.1]], dtype=F64, requires_grad=True)
    routing_diversification_loss(logits.softmax(dim=1)).backward()
    stepped = (logits - 1.0 * logits.grad).softmax(dim=1)
    assert routing_diversification_loss(stepped) < routing_diversification_loss(logits.softmax(dim=1))
