"""The lean decoder equals transformers' forward on every family it claims (engines/lean_decoder.py):
Llama tied and untied (and llama3 rope), Qwen2 with q/k/v bias, Qwen3 with per-head q/k norms and a
head_dim of its own, Mistral with a sliding window shorter than the sequence. Several weight sets
decode their own rows; the weights are views of one flat set, nothing copied."""

from __future__ import annotations

import pytest
import torch

from threepo.services.sampling.engines import lean_decoder
from threepo.services.sampling.engines.lean_decoder import LeanDecoder, WeightLayout

COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def _model(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cfg = {
        "llama_tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
        "llama_untied_llama3_rope": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "llama_biases": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
        "qwen2_bias": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False),
        "mistral_window": lambda: MistralConfig(**COMMON, sliding_window=4),
    }[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their init, so a missing one would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model


FAMILIES = ["llama_tied", "llama_untied_llama3_rope", "llama_biases", "qwen2_bias", "qwen3", "mistral_window"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_steps_equal_transformers(family):
    model = _model(family)
    assert lean_decoder.supports(model)
    params = dict(model.named_parameters())
    layout = WeightLayout.of(model, list(params))
    sets = torch.empty(2, layout.numel)
    other = {}
    for s in range(2):  # set 1 is the model with every weight moved
        for i, (name, view) in enumerate(layout.views(sets[s]).items()):
            shift = 0.02 * s * torch.randn(view.shape, generator=torch.Generator().manual_seed(i))
            view.copy_(params[name].detach() + shift)
            other[name] = view if s else None
    lean = LeanDecoder(model, layout, sets)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]] * 2)  # left padding in rows 0, 2
    attn = (torch.arange(7)[None, :] >= torch.tensor([2, 0, 2, 0])[:, None]).long()
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    steps = torch.tensor([[20, 21, 22], [23, 24, 25]] * 2)
    cache = lean.new_cache(4, 10, torch.float32)
    keys = torch.zeros(4, 10, dtype=torch.bool)
    keys[:, :7] = attn.bool()
    with torch.no_grad():
        got = [lean.forward(ids, positions, cache, 0, keys)]
        for j in range(3):
            keys[:, 7 + j] = True
            got.append(lean.forward(steps[:, j:j + 1], positions[:, -1:] + 1 + j, cache, 7 + j, keys))
        full = torch.cat([ids, steps], 1)
        full_attn = torch.cat([attn, torch.ones(4, 3, dtype=torch.long)], 1)
        full_pos = (full_attn.cumsum(-1) - 1).clamp(min=0)
        want = model(input_ids=full[:2], attention_mask=full_attn[:2], position_ids=full_pos[:2]).logits
        for name, p in model.named_parameters():
            p.data = other[name].clone()
        want_other = model(input_ids=full[2:], attention_mask=full_attn[2:], position_ids=full_pos[2:]).logits
    for j, logits in enumerate(got):
        torch.testing.assert_close(logits[:2], want[:, 6 + j], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(logits[2:], want_other[:, 6 + j], atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got[0][:2], got[0][2:])  # the two sets really are two policies


def test_fused_groups_are_views_of_the_flat_set_and_binding_keeps_the_model_exact():
    model = _model("qwen2_bias")
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = WeightLayout.of(model, list(reference))
    flat = torch.empty(layout.numel)
    lean_decoder.bind(model, layout, flat)
    for name, p in model.named_parameters():
        assert torch.equal(p, reference[name]) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    qkv = layout.fused_view(flat[None], "0.qkv_w")[0]
    a = "model.layers.0.self_attn."
    torch.testing.assert_close(qkv, torch.cat([reference[a + x + "_proj.weight"] for x in "qkv"]), rtol=0, atol=0)
    assert qkv.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_families_it_does_not_implement_are_not_claimed(tiny_moe_path):
    from threepo.services.model.modeling import load_model

    assert not lean_decoder.supports(load_model(tiny_moe_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_slots_decoded_together_equal_each_slot_alone_as_a_whole_set(dtype):
    # slots that perturb some tensors hold those alone; the rest is read from the one shared set
    model = _model("llama_biases")
    params = dict(model.named_parameters())
    layout = WeightLayout.of(model, list(params))
    noised = [n for n in params if (".mlp." in n or "q_proj.weight" in n) and n.endswith("weight")]
    names = lean_decoder.slot_names(layout, noised)
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.embed_tokens.weight" not in names
    with pytest.raises(ValueError, match="fused group"):  # q alone would split the fused q/k/v matmul
        LeanDecoder(model, layout, torch.zeros(1, layout.numel, dtype=dtype),
                    slots=(WeightLayout.of(model, noised), torch.zeros(2, 1, dtype=dtype)))
    slot_layout = WeightLayout.of(model, names)
    shared, own = torch.empty(1, layout.numel, dtype=dtype), torch.empty(2, slot_layout.numel, dtype=dtype)
    whole = torch.empty(2, layout.numel, dtype=dtype)  # each slot as a weight set of its own
    for name, view in layout.views(shared[0]).items():
        view.copy_(params[name].detach())
    for s in range(2):
        for i, (name, view) in enumerate(slot_layout.views(own[s]).items()):
            moved = 0.05 * torch.randn(view.shape, generator=torch.Generator().manual_seed(10 * s + i))
            view.copy_(params[name].detach() + (moved if name in noised else 0))
        whole[s] = shared[0]
        views = layout.views(whole[s])
        for name, view in slot_layout.views(own[s]).items():
            views[name].copy_(view)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]] * 2)
    positions = torch.arange(4).repeat(4, 1)
    keys = torch.ones(4, 4, dtype=torch.bool)
    together = LeanDecoder(model, layout, shared, slots=(slot_layout, own))
    with torch.no_grad():
        got = together.forward(ids, positions, together.new_cache(4, 4, dtype), 0, keys)
        for s in range(2):
            alone = LeanDecoder(model, layout, whole[s:s + 1])
            want = alone.forward(ids[2 * s:2 * s + 2], positions[:2], alone.new_cache(2, 4, dtype), 0, keys[:2])
            torch.testing.assert_close(got[2 * s:2 * s + 2].float(), want.float(),
                                       **({} if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)))
    assert not torch.allclose(got[0], got[2])  # the same prompt under two slots: two policies
