"""Noise masks by parameter name (algorithms/noise_mask.py): what a served slot perturbs."""

from __future__ import annotations

import pytest
import torch

from threepo.algorithms.noise_mask import MaskedSigma, layer_of, noised_names

LLAMA = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.{i}.{part}" for i in range(4) for part in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
GPT2 = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
        "transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight"]


def test_by_default_no_embeddings_head_norms_or_biases():
    chosen = noised_names(LLAMA)
    assert len(chosen) == 4 * 6  # q, k, o, gate, up, down of each layer
    assert not any(w in n for n in chosen for w in ("embed", "norm", "lm_head", ".bias"))
    assert noised_names(GPT2) == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                                  "transformer.h.1.mlp.c_proj.weight"}
    assert noised_names(LLAMA, "everything") == set(LLAMA)


def test_module_families_and_layer_ranges():
    mlp, attention = noised_names(LLAMA, "mlp"), noised_names(LLAMA, "attention")
    assert mlp | attention == noised_names(LLAMA) and not mlp & attention
    assert all(".mlp." in n for n in mlp) and all(".self_attn." in n for n in attention)
    assert {layer_of(n) for n in noised_names(LLAMA, layers=(2, -1))} == {2, 3}
    assert {layer_of(n) for n in noised_names(LLAMA, layers=(-1, -1))} == {3}
    assert {layer_of(n) for n in noised_names(LLAMA, "mlp", layers=(0, 1))} == {0, 1}
    assert noised_names(LLAMA, layers=(5, 9)) == set()
    with pytest.raises(ValueError, match="noise.modules"):
        noised_names(LLAMA, "embeddings")


def test_masked_sigma_holds_the_mask_alone():
    sigmas = {"a": torch.full((2, 3), 0.1), "b": torch.full((4,), 0.2), "c": torch.full((1,), 0.3)}
    masked = MaskedSigma(sigmas, {"a", "c"})
    assert list(masked) == ["a", "c"] and len(masked) == 2 and "b" not in masked and "a" in masked
    assert "d" not in MaskedSigma(sigmas, {"a", "d"})  # noised but absent from σ
    assert torch.equal(masked["a"], sigmas["a"]) and masked.get("b") is None
    with pytest.raises(KeyError):
        masked["b"]


def test_asking_whether_sigma_covers_a_tensor_computes_no_sigma():
    from threepo.algorithms.param_noise import SigmaView

    class Counted(dict):  # h by name, counting reads
        reads = 0

        def __getitem__(self, name):
            Counted.reads += 1
            return super().__getitem__(name)

    view = SigmaView(Counted(w=torch.ones(3), v=torch.ones(2)), 10.0, 0.0)
    masked = MaskedSigma(view, {"w"})
    assert "w" in view and "x" not in view and "w" in masked and "v" not in masked
    assert Counted.reads == 0  # membership reads no h: σ is computed only when a tensor is read
    assert torch.allclose(masked["w"], torch.full((3,), 10.0 ** -0.5)) and Counted.reads == 1
