"""The KL between policies and the σ scale step that holds a slot's KL at a target."""

from __future__ import annotations

import math

import pytest
import torch

from threepo.algorithms.noise_scale import next_noise_scale, policy_kl


def test_policy_kl_is_the_exact_kl_over_the_vocabulary_at_the_temperature():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen)
    for t in (1.0, 0.7):
        want = torch.nn.functional.kl_div(torch.log_softmax(q / t, -1), torch.log_softmax(p / t, -1),
                                          log_target=True, reduction="none").sum(-1)
        assert torch.allclose(policy_kl(p, q, t), want, atol=1e-6)
    assert torch.allclose(policy_kl(p, p, 1.0), torch.zeros(5), atol=1e-7)
    assert bool((policy_kl(p, q, 1.0) > 0).all())
    # a hotter temperature flattens both: less divergence
    assert bool((policy_kl(p, q, 2.0) < policy_kl(p, q, 1.0)).all())


def test_under_the_quadratic_law_one_step_reaches_the_target():
    law = lambda c: 0.3 * c * c  # noqa: E731  KL(c) = a c²
    c = next_noise_scale(0.5, law(0.5), target_kl=0.1)
    assert law(c) == pytest.approx(0.1)
    # a real policy's KL is only near quadratic: the step is bounded per version, and repeated steps converge
    c, quartic = 1.0, lambda c: 0.2 * c * c + 0.5 * c ** 4  # noqa: E731
    for _ in range(8):
        c = next_noise_scale(c, quartic(c), target_kl=0.01)
    assert quartic(c) == pytest.approx(0.01, rel=1e-3)


def test_the_step_is_bounded_and_a_zero_kl_takes_the_largest_step_up():
    assert next_noise_scale(1.0, 100.0, 1e-4, max_factor=4.0) == pytest.approx(0.25)
    assert next_noise_scale(1.0, 1e-9, 1.0, max_factor=4.0) == pytest.approx(4.0)
    assert next_noise_scale(2.0, 0.0, 0.01, max_factor=3.0) == pytest.approx(6.0)
    assert next_noise_scale(1.0, 0.01, 0.01) == pytest.approx(1.0)
    assert math.isfinite(next_noise_scale(1e-3, 1e-12, 1e-2, max_factor=100.0))
