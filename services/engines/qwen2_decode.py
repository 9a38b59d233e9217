"""A lean decoder for dense Qwen2 models: the hf engine's fast path for sampling.

At the embedded default's size a transformers forward of one decode step spends most of its time in
Python (mask building, cache objects, module dispatch), not in arithmetic. `LeanQwen2` runs the same
computation directly on the model's weights, taken when it is built (the engine builds one per batch,
so weights it loads in place are used at once), with q/k/v and gate/up fused into one matmul each:
RMSNorm, q/k/v projections with bias, rotary embedding, grouped-query scaled-dot-product attention
over a preallocated KV cache, SiLU-gated MLP, final norm and the (tied) LM head, in the order
transformers' Qwen2 does them — its logits equal transformers' to fp32
rounding (tests/services/test_engine_hf.py compares them; the conformance suite compares the
behaviour log-probs with the learner's transformers forward).

Only what the embedded default and plain Qwen2 checkpoints use: default rotary embedding, no sliding
window; `LeanQwen2.supports(model)` says whether a model qualifies (the engine falls back to
transformers otherwise).
"""

from __future__ import annotations

import torch


class LeanQwen2:
    """Prefill and one-token decode steps of a dense Qwen2 `model` (a transformers Qwen2ForCausalLM)."""

    @staticmethod
    def supports(model) -> bool:
        cfg = model.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False)
                and rope.get("rope_type", "default") == "default" and cfg.hidden_act == "silu")

    def __init__(self, model) -> None:
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.layers.append(dict(
                    in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                    qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_b=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                    o_w=a.o_proj.weight, gate_up_w=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    down_w=mlp.down_proj.weight))
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, d]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.kv_heads, length, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.model.model.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list, start: int,
                key_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last of `tokens` [B, T] at `positions` [B, T], writing their keys and
        values at cache columns start..start+T-1; `key_mask` [B, start+T] (True = attend) marks the
        real keys (left padding is False). Causality within `tokens` is applied here."""
        m = self.model.model
        x = m.embed_tokens.weight[tokens]
        b, t = tokens.shape
        cos, sin = self._rope(positions, x.dtype)
        end = start + t
        allowed = key_mask[:, None, None, :end]
        if t > 1:  # queries attend to keys up to themselves; a padding query to itself only (no NaN)
            causal = torch.ones(t, end, dtype=torch.bool).tril(start)
            itself = torch.zeros(t, end, dtype=torch.bool)
            itself[torch.arange(t), start + torch.arange(t)] = True
            allowed = (allowed & causal) | itself
        for w, (k_cache, v_cache) in zip(self.layers, cache):
            h = self._norm(x, w["in_norm"])
            q, k, v = torch.nn.functional.linear(h, w["qkv_w"], w["qkv_b"]).split(self.split, dim=-1)
            q = q.reshape(b, t, self.heads, -1).transpose(1, 2)
            k = k.reshape(b, t, self.kv_heads, -1).transpose(1, 2)
            v = v.reshape(b, t, self.kv_heads, -1).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=allowed, enable_gqa=self.heads != self.kv_heads)
            x = x + torch.nn.functional.linear(out.transpose(1, 2).reshape(b, t, -1), w["o_w"])
            gate, up = torch.nn.functional.linear(self._norm(x, w["post_norm"]), w["gate_up_w"]).chunk(2, dim=-1)
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w["down_w"])
        x = self._norm(x[:, -1], m.norm.weight)
        return torch.nn.functional.linear(x, self.model.lm_head.weight)
