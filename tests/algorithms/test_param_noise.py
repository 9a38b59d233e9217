"""The engines' weight check `value_fingerprint`: what its docstring promises, against a plain
int64 reference of the same sums."""

import numpy as np
import torch

from threepo.algorithms.param_noise import noise_like
from threepo.algorithms.weight_checks import value_fingerprint


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


def test_low_rank_noise_is_of_its_rank_with_unit_variance_per_element_and_full_noise_on_vectors():
    from threepo.algorithms.param_noise import low_rank_noise

    for rank in (1, 3):
        z = low_rank_noise(7, "layers.0.mlp.w", (40, 30), rank, torch.empty(40, 30))
        assert torch.linalg.matrix_rank(z).item() == rank
        again = low_rank_noise(7, "layers.0.mlp.w", (40, 30), rank, torch.empty(40, 30))
        assert torch.equal(z, again) and not torch.equal(z, low_rank_noise(8, "layers.0.mlp.w", (40, 30), rank,
                                                                              torch.empty(40, 30)))
    # over many seeds every element has mean 0 and variance 1, like full noise
    draws = torch.stack([low_rank_noise(s, "w", (6, 5), 2, torch.empty(6, 5)) for s in range(4000)])
    assert draws.mean(0).abs().max() < 0.1 and (draws.var(0) - 1).abs().max() < 0.15
    # a 3-D tensor is a matrix over its first axis and the rest; a vector gets full noise
    assert torch.linalg.matrix_rank(low_rank_noise(1, "e", (4, 3, 5), 1, torch.empty(4, 3, 5)).view(4, 15)).item() == 1
    assert torch.equal(low_rank_noise(1, "b", (9,), 2, torch.empty(9)), noise_like(1, "b", (9,)))


def test_a_low_rank_slot_is_built_the_same_by_every_helper_and_differs_from_the_full_one():
    from threepo.algorithms.param_noise import load_perturbed, perturbed, perturbed_state

    gen = torch.Generator().manual_seed(0)
    means = {"a.weight": torch.randn(8, 6, generator=gen), "a.bias": torch.randn(6, generator=gen)}
    sigmas = {n: torch.full_like(m, 0.1) for n, m in means.items()}
    state = perturbed_state(means, sigmas, 5, 2.0, rank=2)
    params = {n: torch.empty_like(m) for n, m in means.items()}
    load_perturbed(params.items(), means, sigmas, 5, 2.0, rank=2)
    for name in means:
        assert torch.equal(state[name], params[name])
        assert torch.equal(state[name], perturbed(means[name], sigmas[name], 5, name, 2.0, rank=2))
    full = perturbed_state(means, sigmas, 5, 2.0)
    assert not torch.equal(full["a.weight"], state["a.weight"]) and torch.equal(full["a.bias"], state["a.bias"])
    assert torch.linalg.matrix_rank(state["a.weight"] - means["a.weight"]).item() == 2
