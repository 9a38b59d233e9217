"""z for one slot switch of a 1.5B-parameter model on the CPU, before and after the counter generator.

A slot switch draws z for every weight. Before (until 2026-12-02): one mt19937 `torch.Generator` per
tensor seeded from (seed, name) and `torch.randn`, single-threaded inside torch whatever the thread
count, a fresh tensor per weight. After: `counter_normal.standard_normal` (integer hashing and a table
lookup, the same bits on every device), into a buffer. The shapes are Qwen2-1.5B's (28 layers, 1536
wide, MLP 8960, vocabulary 151,936, tied head: 1.54B parameters); only z is drawn (m and σ would take
12 GB here). One process, one heavy job; each arm is run `--repeats` times per thread count, interleaved.

    python3 benchmarks/noise_draw.py [--threads 1 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from threepo.algorithms import counter_normal
from threepo.algorithms.param_noise import tensor_seed


def qwen2_1p5b_shapes() -> dict[str, tuple[int, ...]]:
    h, kv, mlp, vocab = 1536, 256, 8960, 151_936
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(28):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (mlp, h),
                       p + "mlp.up_proj.weight": (mlp, h), p + "mlp.down_proj.weight": (h, mlp),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return shapes


def before(shapes: dict, seed: int) -> None:
    """The generator threepo used before: mt19937 per tensor, `torch.randn`, a fresh tensor each."""
    for name, shape in shapes.items():
        gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
        torch.randn(shape, generator=gen, dtype=torch.float32)


def after(shapes: dict, seed: int, buffer: torch.Tensor) -> None:
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        counter_normal.standard_normal(tensor_seed(seed, name), n, out=buffer[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    shapes = qwen2_1p5b_shapes()
    total = sum(torch.Size(s).numel() for s in shapes.values())
    buffer = torch.empty(max(torch.Size(s).numel() for s in shapes.values()))
    buffer.zero_()  # touched once, as an engine's reused build buffer is
    print(f"Qwen2-1.5B shapes: {len(shapes)} tensors, {total / 1e9:.2f}B parameters")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {"before": [], "after": []}
        for r in range(args.repeats):
            for arm in ("before", "after"):
                start = time.perf_counter()
                before(shapes, r) if arm == "before" else after(shapes, r, buffer)
                times[arm].append(time.perf_counter() - start)
                print(f"  threads {threads} repeat {r} {arm}: {times[arm][-1]:.2f} s", flush=True)
        b, a = min(times["before"]), min(times["after"])
        rows.append((threads, b, a))
    print("\n| torch threads | before (mt19937 randn) s | after (counter) s | before / after |")
    print("|---|---|---|---|")
    for threads, b, a in rows:
        print(f"| {threads} | {b:.2f} | {a:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
