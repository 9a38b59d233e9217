"""Counter-based N(0, 1) draws, bit-identical on every device (the z of algorithms.md §1.6).

Element i (flat, row-major) of the draw for a 64-bit key k:

    (a, b) = (hi32 | 1, lo32) of splitmix64(k)   per key, in Python: nearby keys give unrelated (a, b)
    x_i = mix32(a · i + b)                       int32 arithmetic, wrapping; mix32 = Wellons' lowbias32
    z_i = Q[x_i >>> 16]                          Q[j] = Φ⁻¹((j + ½) / 2^16) / s,  s² = mean_j Φ⁻¹((j + ½) / 2^16)²

z is the standard normal quantized to 2^16 equiprobable levels (|z| ≤ 4.32), its table scaled so that
E z = 0 and E z² = 1 hold exactly over the levels (E z⁴ = 2.9992; Kolmogorov distance to N(0, 1)
≤ 2⁻¹⁷). Every step is an integer operation or a table lookup, so a CPU, a GPU and numpy draw the
same bits; Q is built once per process in fp64 (`torch.special.ndtri`) and rounded to fp32 (pinned by
`param_noise.NOISE_SIGNATURE`). There is no generator state: nothing round-trips to the host on a
GPU, and the draw for any subset of elements (a tensor-parallel shard, a strided sample) is computed
from their indices alone, equal to those elements of the whole draw. lowbias32: C. Wellons,
"Prospecting for hash functions" (2018), multipliers 0x7feb352d and 0x846ca68b; splitmix64: Steele,
Lea and Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014), its output function.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

LEVELS = 1 << 16
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers as int32
CPU_CHUNK, DEVICE_CHUNK = 1 << 18, 1 << 24  # elements per pass: cache-sized on a CPU, few launches on a GPU


GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment γ


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function of uint64 `x` (its state already advanced), elementwise, wrapping:
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27; x *= 0x94d049bb133111eb; x ^= x >> 31."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def as_int32(v: int) -> int:
    """A Python integer wrapped to the int32 it is mod 2^32."""
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


def stream(key: int) -> tuple[int, int]:
    """(a, b) of `key` as unsigned 32-bit integers: the high half of splitmix64(key + γ) made odd, the low half."""
    with np.errstate(over="ignore"):
        v = int(splitmix64(np.array([key], dtype=np.uint64) + GOLDEN)[0])
    return (v >> 32) | 1, v & 0xFFFFFFFF


@functools.cache
def levels(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Q, the 2^16 levels of z in fp32 on `device` (ascending, Q[j] = −Q[2^16 − 1 − j])."""
    if device.type != "cpu":
        return levels(torch.device("cpu")).to(device)
    quantiles = torch.special.ndtri((torch.arange(LEVELS, dtype=torch.float64) + 0.5) / LEVELS)
    return (quantiles / quantiles.square().mean().sqrt()).float()


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """lowbias32 in place on int32 `x` (`tmp`: scratch of x's shape): x ^= x >>> 16; x *= M1;
    x ^= x >>> 15; x *= M2; x ^= x >>> 16, each logical shift an arithmetic shift and a mask."""
    for shift, mult in ((16, _M1), (15, _M2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)


def _from_counters_(x: torch.Tensor, key: int, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """out ← z of the int32 counters `x` (x overwritten; `tmp`: int32 scratch of x's shape)."""
    a, b = stream(key)
    x.mul_(as_int32(a)).add_(as_int32(b))
    _mix32_(x, tmp)
    x.bitwise_right_shift_(16).bitwise_and_(LEVELS - 1)
    torch.index_select(levels(x.device), 0, x, out=out)


def standard_normal(key: int, numel: int, *, device: torch.device | str = "cpu", start: int = 0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """z_i for i in [start, start + numel) of `key`'s draw: fp32 [numel] on `device`, or written
    into `out` (contiguous fp32 of numel elements, any shape, on its own device) and returned."""
    assert 0 <= start and start + numel <= 1 << 31, f"counters [{start}, {start + numel}) reach past 2^31"
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=device)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, "out: contiguous fp32"
    flat, dev = out.view(-1), out.device
    chunk = max(1, min(numel, CPU_CHUNK if dev.type == "cpu" else DEVICE_CHUNK))
    x, tmp = (torch.empty(chunk, dtype=torch.int32, device=dev) for _ in range(2))
    for lo in range(0, numel, chunk):
        n = min(chunk, numel - lo)
        torch.arange(start + lo, start + lo + n, dtype=torch.int32, device=dev, out=x[:n])
        _from_counters_(x[:n], key, flat[lo:lo + n], tmp[:n])
    return out


def standard_normal_at(key: int, index: torch.Tensor) -> torch.Tensor:
    """z at the flat element indices `index` (an integer tensor, values in [0, 2^31)) of `key`'s
    draw: fp32 of index's shape on its device, equal to `standard_normal(key, n)[index]`."""
    x = index.to(torch.int32).flatten().clone()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _from_counters_(x, key, out, torch.empty_like(x))
    return out.view(index.shape)
