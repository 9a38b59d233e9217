"""The engines' weight check `value_fingerprint`: what its docstring promises, against a plain
int64 reference of the same sums."""

import numpy as np
import torch

from threepo.algorithms.param_noise import value_fingerprint


def _reference(tensors) -> tuple[int, int]:
    """(Σ b, Σ mix(b)) mod 2^32 over int32 bit patterns, summed in Python-sized integers."""
    total = mixed = 0
    for t in tensors:
        bits = t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()]).flatten()
        b = bits.numpy().astype(np.int64)
        spread = (b * -1640531527 + (1 << 31)) % (1 << 32) - (1 << 31)  # int32 product, wrapped
        total, mixed = total + int(b.sum()), mixed + int((spread ^ (spread >> 15)).sum())
    wrap = lambda v: (v + (1 << 31)) % (1 << 32) - (1 << 31)  # noqa: E731
    return wrap(total), wrap(mixed)


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 48, generator=gen), torch.randn(48, generator=gen), torch.randn(7, 3, generator=gen)]


def test_fingerprint_equals_the_wrapped_sums():
    tensors = _weights()
    assert value_fingerprint(tensors) == _reference(tensors)
    half = [t.to(torch.bfloat16) for t in tensors]
    assert value_fingerprint(half) == _reference(half)


def test_fingerprint_ignores_layout_fusing_and_zero_padding():
    a, b, c = _weights()
    fused = [torch.cat([a, torch.zeros(64, 48)]).T, torch.cat([b, c.flatten()]), torch.zeros(5)]
    assert value_fingerprint(fused) == value_fingerprint([a, b, c])
    assert value_fingerprint([c, a, b]) == value_fingerprint([a, b, c])


def test_fingerprint_changes_with_any_single_element_and_with_compensating_changes():
    tensors = _weights()
    before = value_fingerprint(tensors)
    for i in (0, 1000, 64 * 48 - 1):
        nudged = [t.clone() for t in tensors]
        nudged[0].view(-1)[i] = torch.nextafter(nudged[0].view(-1)[i], torch.tensor(np.inf))  # one ulp
        assert value_fingerprint(nudged)[0] != before[0]
    # two elements changed so that Σ b stays put: the mixed sum still tells
    bits = tensors[0].view(torch.int32).view(-1).clone()
    bits[0], bits[1] = bits[0] + 12345, bits[1] - 12345
    moved = [bits.view(torch.float32).view(64, 48), *tensors[1:]]
    after = value_fingerprint(moved)
    assert after[0] == before[0] and after[1] != before[1]
