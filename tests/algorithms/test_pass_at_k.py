import itertools
import math

import numpy as np
import pytest

from threepo.algorithms.pass_at_k import pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(s < c for s in subset) for subset in subsets) / len(subsets)


def test_matches_enumeration_over_subsets():
    cases = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]
    for k in range(1, 8):
        group = [(n, c) for n, c, kk in cases if kk == k]
        n = np.array([g[0] for g in group])
        c = np.array([g[1] for g in group])
        got = pass_at_k(n, c, k)
        want = np.array([brute_force(nn, cc, k) for nn, cc in group])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_hand_computed_and_edge_cases():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    # k=1 reduces to the success fraction c/n.
    np.testing.assert_allclose(pass_at_k([10, 8, 4], [3, 0, 4], 1), [0.3, 0.0, 1.0], atol=1e-15)
    # n - c < k: every subset holds a correct sample.
    assert pass_at_k(4, 3, 2) == 1.0


def test_stable_for_large_n():
    # The ratio form's binomials overflow float64 here; the product form stays finite and exact.
    n, c, k = 2000, 10, 100
    want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)


def test_shapes_and_errors():
    assert pass_at_k(np.full((2, 3), 4), np.ones((2, 3), dtype=int), 2).shape == (2, 3)
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k([3, 10], [1, 1], 4)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k([3], [4], 1)
    with pytest.raises(ValueError, match="k: expected"):
        pass_at_k([3], [1], 0)
    with pytest.raises(ValueError, match="equal shapes"):
        pass_at_k([3, 3], [1], 1)
