"""VP2O's pure functions on a real (tiny) transformers MoE: fused expert layouts, router top-k,
and the order of operations of one VP2O step (algorithms.md §3.8)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from threepo.algorithms.moe import (  # noqa: E402
    coactivation_sets,
    coactivation_stats,
    expert_orthogonality_loss,
    expert_outputs,
    routing_diversification_loss,
    update_coactivation_ema,
)
from threepo.algorithms.svgd import angular_kernel, attract_expert_grads, prototypes, repulsion_energy  # noqa: E402
from threepo.algorithms.vp2o import prototype_drift_fn, shrink_to_anchor_budget  # noqa: E402

E, K, H, I = 4, 2, 32, 16


def _tiny_moe():
    config = transformers.Qwen3MoeConfig(
        hidden_size=H, num_hidden_layers=1, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=40,
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).float()


def _capture(moe_block):
    seen = {}
    moe_block.gate.register_forward_hook(lambda m, args, out: seen.update(logits=out[0], topk_idx=out[2], weights=out[1]))
    moe_block.experts.register_forward_pre_hook(lambda m, args: seen.update(hidden=args[0]))
    moe_block.experts.register_forward_hook(lambda m, args, out: seen.update(out=out))
    return seen


def test_vp2o_step_on_qwen3_moe_layouts():
    model = _tiny_moe()
    moe = model.model.layers[0].mlp
    experts = moe.experts
    assert experts.down_proj.shape == (E, H, I) and experts.gate_up_proj.shape == (E, 2 * I, H)
    seen = _capture(moe)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 40, (3, 9), generator=gen)
    mask = torch.ones(3 * 9, dtype=torch.bool)
    mask[-4:] = False  # padding tokens of the last row

    out = model(input_ids=input_ids, labels=input_ids)
    topk_idx, hidden = seen["topk_idx"], seen["hidden"]
    assert topk_idx.shape == (27, K) and hidden.shape == (27, H)

    # our reading of the fused layout reproduces the layer: Σ_k w_{t,k} y_{t,k} = experts(x)
    y = expert_outputs(hidden, experts.gate_up_proj, experts.down_proj, topk_idx)
    torch.testing.assert_close((seen["weights"][:, :, None] * y).sum(dim=1), seen["out"], atol=1e-6, rtol=1e-5)

    l_orth = expert_orthogonality_loss(y, mask)
    l_div = routing_diversification_loss(seen["logits"].softmax(dim=-1), mask)
    assert 0.0 < l_orth.item() < 1.0 and l_div.item() < 0.0
    (out.loss + 1e-3 * l_orth + 1e-3 * l_div).backward()
    down_grad, gate_up_grad = experts.down_proj.grad, experts.gate_up_proj.grad
    assert down_grad.shape == (E, H, I) and gate_up_grad.shape == (E, 2 * I, H)

    # prototypes of the real down_proj: top left singular vectors up to sign
    p, v = prototypes(experts.down_proj, None, n_iter=200, generator=torch.Generator().manual_seed(0))
    u1 = torch.linalg.svd(experts.down_proj.detach()).U[:, :, 0]
    torch.testing.assert_close((p.detach() * u1).sum(dim=1).abs(), torch.ones(E), atol=1e-4, rtol=0)
    kern, h = angular_kernel(p)
    assert kern.shape == (E, E)

    f, c = coactivation_stats(topk_idx, E, mask)
    f_hat, c_hat = update_coactivation_ema(None, None, f, c, 0.9)
    attract, repel = coactivation_sets(f_hat, c_hat)
    assert f.sum().item() == pytest.approx(K) and attract.shape == repel.shape == (E, E)

    # attraction over every fused tensor of the layer, then repulsion reaches down_proj only
    everyone = ~torch.eye(E, dtype=torch.bool)
    spread_before = down_grad.std(dim=0).sum()
    with torch.no_grad():
        down_grad.copy_(attract_expert_grads(down_grad, kern, everyone, alpha_att=1.0))
        gate_up_grad.copy_(attract_expert_grads(gate_up_grad, kern, everyone, alpha_att=1.0))
    # all experts attract everyone with α = 1: rows become kernel-weighted means, closer together
    assert 0 < down_grad.std(dim=0).sum() < spread_before
    gate_up_before, down_before = gate_up_grad.clone(), down_grad.clone()
    (1e-3 * repulsion_energy(p, h, everyone)).backward()
    assert torch.equal(experts.gate_up_proj.grad, gate_up_before)
    assert not torch.equal(experts.down_proj.grad, down_before)

    # a plain SGD step, then the anchor budget shrinks the experts that drifted too far
    prev = [experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()]
    new = [w - 50.0 * w.grad for w in (experts.gate_up_proj, experts.down_proj)]
    drift = prototype_drift_fn(p.detach(), v, down_index=1, n_iter=200)
    budget = 2.5e-3
    blocks, scale, frac = shrink_to_anchor_budget(prev, new, drift, budget)
    assert frac > 0 and (drift(blocks) <= budget).all()
    with torch.no_grad():
        experts.gate_up_proj.copy_(blocks[0])
        experts.down_proj.copy_(blocks[1])
    assert torch.isfinite(model(input_ids=input_ids, labels=input_ids).loss)
