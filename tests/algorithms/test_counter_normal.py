"""The counter-based z (algorithms/counter_normal.py) against a numpy reference of its formula, and
what its docstring promises: the same bits whatever the chunking, offset, subset or thread count,
unit variance over its levels, a draw close to N(0, 1), unrelated streams for different keys; and
param_noise's use of it: the device check, θ̂'s documented operation order, exact z at sampled points."""

import numpy as np
import pytest
import torch

from threepo.algorithms import counter_normal, param_noise, weight_checks


def _reference(key: int, start: int, n: int) -> np.ndarray:
    """The docstring's formula in numpy uint32 arithmetic (wrapping, logical shifts)."""
    mask = (1 << 64) - 1
    v = (key + 0x9E3779B97F4A7C15) & mask
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & mask
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & mask
    v ^= v >> 31
    with np.errstate(over="ignore"):
        i = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
        x = i * np.uint32((v >> 32) | 1) + np.uint32(v & 0xFFFFFFFF)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return counter_normal.levels().numpy()[x >> np.uint32(16)]


@pytest.mark.parametrize("key,start,n", [(0, 0, 5000), (0x5EED, 123, 70_000), ((1 << 63) - 1, (1 << 31) - 9000, 9000),
                                         (param_noise.tensor_seed(7, "model.layers.0.mlp.up_proj.weight"), 0, 300_001)])
def test_draw_equals_the_documented_formula_bit_for_bit(key, start, n):
    z = counter_normal.standard_normal(key, n, start=start)
    assert np.array_equal(z.numpy().view(np.int32), _reference(key, start, n).view(np.int32))


def test_the_same_bits_whatever_the_chunking_offset_subset_and_threads(monkeypatch):
    key, n = 987654321, 200_003
    whole = counter_normal.standard_normal(key, n)
    monkeypatch.setattr(counter_normal, "CPU_CHUNK", 4099)
    assert torch.equal(counter_normal.standard_normal(key, n), whole)
    assert torch.equal(counter_normal.standard_normal(key, 1000, start=50_000), whole[50_000:51_000])
    index = torch.tensor([[0, 7], [n - 1, 123_456]])
    assert torch.equal(counter_normal.standard_normal_at(key, index), whole[index])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(counter_normal.standard_normal(key, n), whole)
    finally:
        torch.set_num_threads(threads)
    out = torch.empty(3, n // 3 + 1)[:, : n // 3].contiguous()
    assert torch.equal(counter_normal.standard_normal(key, out.numel(), out=out).flatten(), whole[: out.numel()])


def test_levels_are_symmetric_with_unit_variance_and_the_draw_is_close_to_normal():
    q = counter_normal.levels().double()
    assert torch.equal(q, -q.flip(0)) and bool((q.diff() > 0).all())
    assert abs(float(q.square().mean()) - 1) < 1e-6 and abs(float(q.pow(4).mean()) - 3) < 2e-3
    z = counter_normal.standard_normal(2024, 1 << 20).double()
    assert abs(float(z.mean())) < 5e-3 and abs(float(z.var()) - 1) < 6e-3
    # Kolmogorov distance of 2^20 draws to Φ: ~1.4 / sqrt(n) = 1.4e-3 at the 99.9th percentile
    s, _ = z.sort()
    cdf = 0.5 * torch.erfc(-s / 2 ** 0.5)
    n = s.numel()
    ks = max(float((torch.arange(1, n + 1) / n - cdf).max()), float((cdf - torch.arange(n) / n).max()))
    assert ks < 2e-3


def test_different_keys_draw_unrelated_streams():
    a = counter_normal.standard_normal(1000, 1 << 16)
    for other in (1001, 1000 + (1 << 32), param_noise.tensor_seed(0, "w")):
        b = counter_normal.standard_normal(other, 1 << 16)
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
        # neither a copy nor a shifted copy of the other stream
        assert float((a[1:] == b[:-1]).float().mean()) < 1e-3 and float((a == b).float().mean()) < 1e-3


def test_a_device_that_draws_other_bits_is_refused(monkeypatch):
    assert param_noise.noise_signature("cpu") == param_noise.NOISE_SIGNATURE
    param_noise.check_noise_device.cache_clear()
    monkeypatch.setattr(param_noise, "NOISE_SIGNATURE", "0" * 16)
    try:
        with pytest.raises(RuntimeError, match="parameter noise drawn on cpu has signature"):
            param_noise.noise_like(1, "w", (3,))
    finally:
        param_noise.check_noise_device.cache_clear()


def test_theta_is_composed_in_the_documented_order_and_never_over_its_mean():
    gen = torch.Generator().manual_seed(3)
    mean, sigma = torch.randn(40, 30, generator=gen), torch.rand(40, 30, generator=gen) * 1e-2
    z = param_noise.noise_like(5, "w", (40, 30))
    assert torch.equal(param_noise.perturbed(mean, sigma, 5, "w"), sigma * z + mean)
    assert torch.equal(param_noise.perturbed(mean, sigma, 5, "w", 0.5), (sigma * z) * 0.5 + mean)
    with pytest.raises(AssertionError):
        param_noise.perturbed(mean, sigma, 5, "w", out=mean)


def test_the_estimated_noise_ratio_uses_the_draw_itself_at_its_points():
    gen = torch.Generator().manual_seed(4)
    means = {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(1000, generator=gen)}
    sigmas = {k: torch.full_like(v, 3e-3) for k, v in means.items()}
    thetas = {k: param_noise.perturbed(means[k], sigmas[k], 11, k) for k in means}
    exact = param_noise.served_noise_ratio_of(means, thetas, torch.bfloat16)
    # every element a point: the estimate is the exact ratio
    assert param_noise.estimated_noise_ratio(means, sigmas, "bfloat16", seed=11, max_points=1 << 16) == pytest.approx(exact, rel=1e-6)


def test_checks_build_every_tensor_on_their_inputs_device():
    """With factory calls that name no device sent to `meta`, the weight checks and the draw still run
    on the CPU inputs they are given: what a GPU engine's checks on CUDA tensors need."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(300, 500, generator=gen)  # > 65521 elements: the checksum's position columns
    weight_checks._positions.cache_clear()  # built afresh inside the meta context
    with torch.device("meta"):
        found = (weight_checks.weights_checksum([("w", w)]), weight_checks.value_fingerprint([w]),
                 param_noise.perturbed(w, torch.full_like(w, 1e-3), 3, "w"))
    expected = (weight_checks.weights_checksum([("w", w)]), weight_checks.value_fingerprint([w]),
                param_noise.perturbed(w, torch.full_like(w, 1e-3), 3, "w"))
    assert found[:2] == expected[:2] and torch.equal(found[2], expected[2])
