"""A lean decoder for dense Qwen2 models: the hf engine's fast path for sampling.

At the embedded default's size a transformers forward of one decode step spends most of its time in
Python (mask building, cache objects, module dispatch), not in arithmetic. `LeanQwen2` runs the same
computation directly on weight tensors, with q/k/v and gate/up fused into one matmul each: RMSNorm,
q/k/v projections with bias, rotary embedding, grouped-query scaled-dot-product attention over a
preallocated KV cache, SiLU-gated MLP, final norm and the (tied) LM head, in the order transformers'
Qwen2 does them — its logits equal transformers' to fp32 rounding (tests/services/test_engine_hf.py
compares them; the conformance suite compares the behaviour log-probs with the learner's
transformers forward).

Several weight sets at once. Built with S `slots` (one weight set per posterior sample θ̂_s), it
decodes S equal groups of rows in one pass: rows [s·b, (s+1)·b) use slot s's weights, every matmul
is one batched matmul over the S stacked weight sets, and attention runs over all S·b rows. A C3PO
call that samples several slots therefore decodes them in one batch instead of one batch per slot,
with no weights copied into the model between them. Built without slots it decodes with the model's
own weights as they are now (S = 1).

Only what the embedded default and plain Qwen2 checkpoints use: default rotary embedding, no sliding
window; `LeanQwen2.supports(model)` says whether a model qualifies (the engine falls back to
transformers otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class LeanQwen2:
    """Prefill and one-token decode steps of a dense Qwen2 `model` (a transformers Qwen2ForCausalLM)
    under S weight sets: `slots[s]` maps parameter names (the model's `named_parameters`) to slot
    s's tensors; a name a slot lacks takes the model's own tensor. `slots` None: the model's weights."""

    @staticmethod
    def supports(model) -> bool:
        cfg = model.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False)
                and rope.get("rope_type", "default") == "default" and cfg.hidden_act == "silu")

    def __init__(self, model, slots: Sequence[Mapping[str, torch.Tensor]] | None = None) -> None:
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        own = dict(model.named_parameters())
        sets = [own] if slots is None else [{**own, **s} for s in slots]
        self.n_slots = len(sets)

        def stack(*names: str, vector: bool = False) -> torch.Tensor:
            parts = [torch.cat([w[n].detach() for n in names]) for w in sets]
            out = torch.stack(parts)
            return out[:, None] if vector else out  # vectors [S, 1, n] broadcast over rows

        def stack_t(*names: str) -> torch.Tensor:
            # matrices [S, in, out], contiguous: bmm runs up to 1.7x faster than on the [S, out, in] view
            return stack(*names).mT.contiguous()

        self.layers = []
        with torch.no_grad():
            self.embed = stack("model.embed_tokens.weight")
            self.tied = "lm_head.weight" not in own or own["lm_head.weight"] is own["model.embed_tokens.weight"]
            self.lm_head = self.embed.mT if self.tied else stack_t("lm_head.weight")
            self.final_norm = stack("model.norm.weight", vector=True)
            for i in range(cfg.num_hidden_layers):
                p = f"model.layers.{i}."
                attn, mlp = p + "self_attn.", p + "mlp."
                self.layers.append(dict(
                    in_norm=stack(p + "input_layernorm.weight", vector=True),
                    post_norm=stack(p + "post_attention_layernorm.weight", vector=True),
                    qkv_w=stack_t(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                    qkv_b=stack(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias", vector=True),
                    o_w=stack_t(attn + "o_proj.weight"),
                    gate_up_w=stack_t(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                    down_w=stack_t(mlp + "down_proj.weight")))
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)

    def slot_tensors(self, s: int) -> list[torch.Tensor]:
        """Every weight tensor slot s decodes with (each once; for the engine's weight check)."""
        out = [self.embed[s], self.final_norm[s]] + ([] if self.tied else [self.lm_head[s]])
        return out + [w[s] for layer in self.layers for w in layer.values()]

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

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [S, R, in] through each slot's w [S, in, out] (and bias [S, 1, out])."""
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias, x, w)

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.kv_heads, length, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list, start: int,
                key_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last of `tokens` [B, T] at `positions` [B, T], B = S·b (rows of slot
        s at [s·b, (s+1)·b)), writing their keys and values at cache columns start..start+T-1;
        `key_mask` [B, start+T] (True = attend) marks the real keys (left padding is False).
        Causality within `tokens` is applied here."""
        rows, t = tokens.shape
        s_n = self.n_slots
        if rows % s_n:
            raise ValueError(f"{rows} rows cannot be split evenly over {s_n} weight slots")
        b = rows // s_n
        slot_of_row = torch.arange(s_n).repeat_interleave(b)
        x = self.embed[slot_of_row[:, None], tokens].reshape(s_n, b * t, -1)
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
            q, k, v = self._linear(h, w["qkv_w"], w["qkv_b"]).split(self.split, dim=-1)
            q = q.reshape(rows, t, self.heads, -1).transpose(1, 2)
            k = k.reshape(rows, t, self.kv_heads, -1).transpose(1, 2)
            v = v.reshape(rows, t, self.kv_heads, -1).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=allowed, enable_gqa=self.heads != self.kv_heads)
            x = x + self._linear(out.transpose(1, 2).reshape(s_n, b * t, -1), w["o_w"])
            gate, up = self._linear(self._norm(x, w["post_norm"]), w["gate_up_w"]).chunk(2, dim=-1)
            x = x + self._linear(torch.nn.functional.silu(gate) * up, w["down_w"])
        last = self._norm(x.reshape(s_n, b, t, -1)[:, :, -1], self.final_norm)
        return self._linear(last, self.lm_head).reshape(rows, -1)
