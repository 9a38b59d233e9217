"""A lean decoder for dense Llama-family models (Llama/SmolLM2, Qwen2/2.5 with or without q/k/v bias,
Qwen3, Mistral; tied or untied head): the hf engine's fast path for sampling.

A transformers forward of one decode step spends much of its time outside arithmetic (mask
building, cache objects, module dispatch). `LeanDecoder` runs the same computation directly on
weight tensors: RMSNorm, q/k/v projections (with bias where the checkpoint has it, per-head q/k
RMSNorm for Qwen3), rotary embedding from the model's own rotary module (its `inv_freq` and
attention scaling: default, linear, llama3 and YaRN rope alike), grouped-query attention over a
preallocated KV cache (with the sliding window where the model has one), SiLU-gated MLP, final norm
and the LM head, in transformers' order — its logits equal transformers' to fp32 rounding
(tests/services/test_lean_decoder.py, per family).

Weights live in one flat buffer per weight set (`WeightLayout`): every parameter is a view of it,
and the parameters that one matmul uses together (q/k/v, gate/up) are consecutive, so the fused
matrix is a view too. S weight sets are a [S, numel] tensor: a decoder over S slots (one posterior
sample θ̂_s each) decodes S equal groups of rows in one pass, rows [s·b, (s+1)·b) with set s, every
matmul one batched matmul over the S sets' views — nothing is copied to stack them (on the CPU in
bf16 one `mm` per set instead: there a batched matmul over views strided by a whole weight set ran
3-10x slower, in fp32 1.4-2x faster; benchmarks/README.md). A C3PO call that samples several slots
therefore decodes them in one batch instead of one batch per slot.

Slots that perturb only some tensors (a noise mask: embeddings, head and norms never carry noise)
hold only those in their sets (`slots` = (their layout, [S, n]); `slot_names`): every other tensor is
read from the one shared set, its matmul one over all S·b rows — the head, the largest, is read once
per step whatever S is.

Slots that are LoRA adapter samples (services/sampling/engines/slot_bank.py `Adapters`) share one base set
instead: `adapters[name] = (Â [S, r, in], B̂ [S, out, r])` per adapted weight, and each projection is
W0 x, one matmul over all S·b rows, plus s · B̂_s Â_s x for set s's rows (two small batched matmuls;
Hu et al. 2021, eq. 3) — the base is read once per step whatever S is.

Not here: sampling, slots and weight checks (engines/hf.py, engines/slot_bank.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq does not depend on the length


def supports(model) -> bool:
    """Can `LeanDecoder` decode this transformers model (a dense family it implements)?"""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    layered_window = cfg.model_type == "qwen2" and getattr(cfg, "use_sliding_window", False)
    return (cfg.model_type in FAMILIES and getattr(cfg, "hidden_act", "") == "silu" and not layered_window
            and rope.get("rope_type", "default") in _STATIC_ROPE
            and hasattr(getattr(model, "model", None), "rotary_emb")
            and getattr(model.get_output_embeddings(), "bias", None) is None)


@dataclass(frozen=True)
class WeightLayout:
    """Where each parameter lives in a flat weight set: `spans[name] = (offset, shape)`, with the
    members of each fused group (`fused[key] = (offset, rows, cols)`) consecutive."""

    spans: dict
    fused: dict
    numel: int

    @staticmethod
    def of(model, names: list[str]) -> WeightLayout:
        """The layout of `names` (the model's parameters, tied ones once): fused groups first."""
        params = dict(model.named_parameters())
        order: list[str] = []
        groups: dict[str, list[str]] = {}
        for i in range(model.config.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for key, members in ((f"{i}.qkv_w", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                                 (f"{i}.qkv_b", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                                 (f"{i}.gate_up_w", [m + "gate_proj.weight", m + "up_proj.weight"]),
                                 (f"{i}.gate_up_b", [m + "gate_proj.bias", m + "up_proj.bias"])):
                if all(n in names for n in members):
                    groups[key] = members
                    order += members
        order += [n for n in names if n not in set(order)]
        spans, at = {}, 0
        for n in order:
            spans[n] = (at, tuple(params[n].shape))
            at += params[n].numel()
        fused = {}
        for key, members in groups.items():
            start = spans[members[0]][0]
            rows = sum(spans[n][1][0] for n in members)
            fused[key] = (start, rows, params[members[0]].shape[1] if params[members[0]].dim() == 2 else 1)
        return WeightLayout(spans, fused, at)

    def members(self, key: str) -> list[str]:
        """The parameters fused group `key` is made of."""
        at, rows, cols = self.fused[key]
        return [n for n, (start, _) in self.spans.items() if at <= start < at + rows * cols]

    def view(self, sets: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name` of weight sets [S, numel] as [S, *shape] (a view)."""
        at, shape = self.spans[name]
        n = int(torch.Size(shape).numel())
        return sets[:, at:at + n].view(sets.shape[0], *shape)

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter of one flat weight set [numel] by name (views)."""
        return {n: self.view(row[None], n)[0] for n in self.spans}

    def fused_view(self, sets: torch.Tensor, key: str) -> torch.Tensor:
        at, rows, cols = self.fused[key]
        return sets[:, at:at + rows * cols].view(sets.shape[0], rows, cols) if cols > 1 else \
            sets[:, at:at + rows].view(sets.shape[0], 1, rows)


def slot_names(layout: WeightLayout, noised) -> list[str]:
    """The tensors a slot's own set holds when `noised` are the ones it perturbs: those, with every
    member of a fused group (q/k/v, gate/up) any of them belongs to (a fused matmul reads one set),
    in `layout`'s order."""
    noised, whole = set(noised), set()
    for members in map(layout.members, layout.fused):
        if noised.intersection(members):
            whole.update(members)
    return [n for n in layout.spans if n in noised or n in whole]


def bind(model, layout: WeightLayout, row: torch.Tensor) -> None:
    """Make the model's parameters views of the flat weight set `row` [numel] (values copied in)."""
    views = layout.views(row)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in views:
                views[name].copy_(p)
                p.data = views[name]


def _slot_count(layout: WeightLayout, sets: torch.Tensor, adapters: dict | None,
                slots: tuple[WeightLayout, torch.Tensor] | None) -> int:
    """S, the weight sets a decoder's rows split into: `sets`' own, or the adapter samples' or masked
    slots' over one shared set (whose own sets must hold whole fused groups)."""
    if (adapters is not None or slots is not None) and sets.shape[0] != 1:
        raise ValueError(f"adapter or masked slots decode over one shared set, got {sets.shape[0]} sets")
    if adapters is not None:
        if not adapters:
            raise ValueError("adapter slots need at least one adapter")
        return next(iter(adapters.values()))[0].shape[0]
    if slots is None:
        return sets.shape[0]
    own = slots[0]
    split = [k for k in layout.fused if k not in own.fused and set(layout.members(k)).intersection(own.spans)]
    if split:
        raise ValueError(f"fused group(s) {split} are partly in the slots' own sets (lean_decoder.slot_names)")
    return slots[1].shape[0]


class _Views:
    """A tensor (or with `fused`, a fused group) by name as [S or 1, ...]: the slots' own where their
    layout holds it, else the shared set's; None where the model has none."""

    def __init__(self, layout: WeightLayout, sets: torch.Tensor, slots: tuple | None, fused: bool = False) -> None:
        self.layout, self.sets, self.fused = layout, sets, fused
        self.own, self.own_sets = slots if slots is not None else (None, None)

    def __call__(self, key: str) -> torch.Tensor | None:
        for layout, sets in ((self.own, self.own_sets), (self.layout, self.sets)):
            if layout is not None and key in (layout.fused if self.fused else layout.spans):
                return layout.fused_view(sets, key) if self.fused else layout.view(sets, key)
        return None


class LeanDecoder:
    """Prefill and one-token decode steps of `model` under the weight sets `sets` [S, numel] laid out
    by `layout` (see the module docstring); `model` gives the architecture and the rotary module.
    With `slots` = (slot layout, [S, n]) the tensors of the slot layout are each slot's own and the
    rest are read from `sets`, then one shared set [1, numel]."""

    def __init__(self, model, layout: WeightLayout, sets: torch.Tensor, adapters: dict | None = None,
                 scaling: float = 1.0, slots: tuple[WeightLayout, torch.Tensor] | None = None,
                 compute: torch.dtype | None = None) -> None:
        """`compute`: the dtype activations are computed in (default the weights'); weights of another
        dtype are cast at each use (fp32 logits of bf16-served weights without an fp32 copy of them)."""
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps, self.device, self.scaling = cfg.rms_norm_eps, sets.device, scaling
        self.dtype = compute or sets.dtype
        self.n_slots = _slot_count(layout, sets, adapters, slots)
        self.window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        # a decode step's attention (one query per row): two fp32 matmuls on the CPU, torch's SDPA elsewhere
        self._one_query = _one_query_attention if sets.device.type == "cpu" else _sdpa
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float().to(sets.device)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        v, fused = _Views(layout, sets, slots), _Views(layout, sets, slots, fused=True)
        vec = lambda name: None if v(name) is None else v(name)[:, None]  # noqa: E731  [S, 1, n] broadcasts over rows
        self.embed = v("model.embed_tokens.weight")
        self.lm_head = v("lm_head.weight") if "lm_head.weight" in layout.spans else self.embed
        self.final_norm = vec("model.norm.weight")
        self.layers = []
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        inter = cfg.intermediate_size

        def terms(*members):  # [(start, end, Â, B̂)] of the adapted members of one (fused) projection
            out, at = [], 0
            for name, width in members:
                if adapters and name in adapters:
                    out.append((at, at + width, *adapters[name]))
                at += width
            return out

        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(dict(
                in_norm=vec(p + "input_layernorm.weight"), post_norm=vec(p + "post_attention_layernorm.weight"),
                qkv_w=fused(f"{i}.qkv_w"), qkv_b=fused(f"{i}.qkv_b"),
                q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"),
                o_w=v(a + "o_proj.weight"), o_b=vec(a + "o_proj.bias"),
                gate_up_w=fused(f"{i}.gate_up_w"), gate_up_b=fused(f"{i}.gate_up_b"),
                down_w=v(m + "down_proj.weight"), down_b=vec(m + "down_proj.bias"),
                qkv_lora=terms((a + "q_proj.weight", q_out), (a + "k_proj.weight", kv_out), (a + "v_proj.weight", kv_out)),
                o_lora=terms((a + "o_proj.weight", cfg.hidden_size)),
                gate_up_lora=terms((m + "gate_proj.weight", inter), (m + "up_proj.weight", inter)),
                down_lora=terms((m + "down_proj.weight", cfg.hidden_size))))
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [B, 1, T, d]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                lora: list = ()) -> torch.Tensor:
        """x [S, R, in] through each set's w [S, out, in] (and bias [S or 1, 1, out]), one batched matmul
        (on the CPU in bf16 one `mm` per set); over one shared set (w [1, out, in]) one matmul for all S·R rows, plus each slot's adapter term
        s · (x Âᵀ) B̂ᵀ on the output columns [start, end) it adapts (`lora`)."""
        s_n, rows, _ = x.shape
        if w.dtype != x.dtype:  # `compute` differs from the weights' dtype: cast at use
            w, bias = w.to(x.dtype), None if bias is None else bias.to(x.dtype)
            lora = [(start, end, a.to(x.dtype), b.to(x.dtype)) for start, end, a, b in lora]
        if w.shape[0] == 1:
            y = torch.nn.functional.linear(x.reshape(s_n * rows, -1), w[0], None if bias is None else bias[0, 0])
            y = y.view(s_n, rows, -1)
        elif not (w.dtype == torch.bfloat16 and w.device.type == "cpu"):
            y = torch.bmm(x, w.mT) if bias is None else torch.baddbmm(bias, x, w.mT)
        else:  # CPU bf16: a bmm over views strided by a whole weight set runs 3-10x slower than a mm each
            y = x.new_empty(s_n, rows, w.shape[1])
            for s in range(s_n):
                if bias is None:
                    torch.mm(x[s], w[s].t(), out=y[s])
                else:
                    torch.addmm(bias[s if bias.shape[0] > 1 else 0, 0], x[s], w[s].t(), out=y[s])
        for start, end, a, b in lora:
            y[..., start:end].add_(torch.bmm(torch.bmm(x, a.mT), b.mT), alpha=self.scaling)
        return y

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.kv_heads, length, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in self.layers]

    def _allowed(self, key_mask: torch.Tensor, start: int, t: int) -> torch.Tensor:
        """[B, 1, T, end] attention mask: real keys, causal within the new tokens, inside the window;
        a padding query attends to itself only (no NaN)."""
        end = start + t
        allowed = key_mask[:, None, None, :end]
        if t > 1 or self.window:
            q_col = start + torch.arange(t, device=key_mask.device)[:, None]
            k_col = torch.arange(end, device=key_mask.device)[None, :]
            rule = k_col <= q_col
            if self.window:  # real tokens are contiguous at the right: column distance is position distance
                rule = rule & (q_col - k_col < self.window)
            allowed = (allowed & rule) | (k_col == q_col)
        return allowed

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list, start: int,
                key_mask: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of the last of `tokens` [B, T] at `positions` [B, T], B = S·b (rows of set
        s at [s·b, (s+1)·b)), writing their keys and values at cache columns start..start+T-1;
        `key_mask` [B, start+T] (True = attend) marks the real keys (left padding is False). With
        `at` [B, T] bool: the logits [N, V] of every marked position instead, in row-major order."""
        rows, t = tokens.shape
        s_n = self.n_slots
        if rows % s_n:
            raise ValueError(f"{rows} rows cannot be split evenly over {s_n} weight sets")
        b = rows // s_n
        if self.embed.shape[0] == 1:  # one shared embedding
            x = self.embed[0][tokens].reshape(s_n, b * t, -1)
        else:
            set_of_row = torch.arange(s_n, device=tokens.device).repeat_interleave(b)
            x = self.embed[set_of_row[:, None], tokens].reshape(s_n, b * t, -1)
        x = x.to(self.dtype)
        cos, sin = self._rope(positions, x.dtype)
        end = start + t
        allowed = self._allowed(key_mask, start, t)
        for w, (k_cache, v_cache) in zip(self.layers, cache):
            h = self._norm(x, w["in_norm"])
            q, k, v = self._linear(h, w["qkv_w"], w["qkv_b"], w["qkv_lora"]).split(self.split, dim=-1)
            q = q.reshape(rows, t, self.heads, -1)
            k = k.reshape(rows, t, self.kv_heads, -1)
            if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head, before rotary
                q = self._norm(q.reshape(s_n, -1, self.head_dim), w["q_norm"]).reshape(rows, t, self.heads, -1)
                k = self._norm(k.reshape(s_n, -1, self.head_dim), w["k_norm"]).reshape(rows, t, self.kv_heads, -1)
            q, k = self._rotate(q.transpose(1, 2), cos, sin), self._rotate(k.transpose(1, 2), cos, sin)
            v = v.reshape(rows, t, self.kv_heads, -1).transpose(1, 2)
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
            out = (self._one_query if t == 1 else _sdpa)(q, k_cache[:, :, :end], v_cache[:, :, :end], allowed)
            x = x + self._linear(out.transpose(1, 2).reshape(s_n, b * t, -1), w["o_w"], w["o_b"], w["o_lora"])
            gate, up = self._linear(self._norm(x, w["post_norm"]), w["gate_up_w"], w["gate_up_b"],
                                    w["gate_up_lora"]).chunk(2, dim=-1)
            x = x + self._linear(torch.nn.functional.silu(gate) * up, w["down_w"], w["down_b"], w["down_lora"])
        if at is not None:
            return self._head_at(x.reshape(s_n, b, t, -1), at.reshape(s_n, b, t))
        last = self._norm(x.reshape(s_n, b, t, -1)[:, :, -1], self.final_norm)
        return self._linear(last, self.lm_head).reshape(rows, -1)

    def _head_at(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of the hidden states x [S, b, T, H] where `at` [S, b, T], set by set."""
        out = []
        for s in range(self.n_slots):
            own = lambda w: w[s:s + 1] if w.shape[0] > 1 else w  # noqa: E731  [1, ...]: this set's or the shared
            picked = self._norm(x[s][at[s]][None], own(self.final_norm))
            out.append(self._linear(picked, own(self.lm_head))[0])
        return torch.cat(out)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + mask) v, q [B, H, T, d] over k, v [B, KV, end, d] (grouped-query: query head
    h reads key/value head h // (H / KV)), `allowed` [B, 1, T, end]: torch's kernel."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                            enable_gqa=q.shape[1] != k.shape[1])


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`_sdpa` for one query per row (T = 1, a decode step) as two batched matmuls in fp32, the query
    heads grouped by the key/value head they read; equal to it to fp32 rounding. On the CPU in bf16
    torch's kernel took 6-8x as long for one query (16 rows, 9 heads over 3, 140-400 keys: 1.5 ms
    against 0.23 ms a layer; fp32 about equal), 44% of a SmolLM2 decode step."""
    rows, heads, _, dim = q.shape
    kv = k.shape[1]
    scores = torch.matmul(q.float().reshape(rows, kv, heads // kv, dim), k.float().transpose(-1, -2))
    scores = scores.mul_(dim ** -0.5).masked_fill_(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).reshape(rows, heads, 1, dim).to(q.dtype)
