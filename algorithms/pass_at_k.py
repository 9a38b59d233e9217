"""Unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", section 2.1), vectorised over problems.

Not here: sampling or scoring; the caller counts, per problem, how many of its n samples passed.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(num_samples: np.ndarray | list[int] | int, num_correct: np.ndarray | list[int] | int,
              k: int) -> np.ndarray:
    """Per-problem unbiased estimate of pass@k from n samples of which c are correct.

        pass@k = 1 − C(n−c, k) / C(n, k)
               = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)          (product form; 1 when n − c < k)

    The product form avoids the huge binomials of the ratio. It is the probability that at least
    one of k samples drawn without replacement from the n is correct, so its mean over problems
    is an unbiased estimate of pass@k (Chen et al. 2021, §2.1, eq. 1 and Figure 3).

    Args:
        num_samples: n per problem, shape [P] (or a scalar); each n >= k.
        num_correct: c per problem, shape [P] (or a scalar); 0 <= c <= n.
        k: samples per attempt, >= 1.
    Returns:
        float64 array of shape [P] (0-d for scalar inputs) with values in [0, 1].
    """
    n = np.asarray(num_samples)
    c = np.asarray(num_correct)
    if n.shape != c.shape:
        raise ValueError(f"num_samples and num_correct: expected equal shapes, got {n.shape} "
                         f"and {c.shape}")
    if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise ValueError("num_samples and num_correct: expected integer counts")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k!r}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("num_correct: expected 0 <= c <= n for every problem")
    if np.any(n < k):
        raise ValueError(f"num_samples: expected n >= k={k} for every problem, got min n = "
                         f"{int(n.min())}")
    n_flat = n.reshape(-1).astype(np.int64)
    c_flat = c.reshape(-1).astype(np.int64)
    # Factor j of problem p is i = n−c+1+j for j < c; padding factors are 1.
    width = int(c_flat.max(initial=0))
    j = np.arange(width, dtype=np.int64)[None, :]  # [1, W]
    i = (n_flat - c_flat + 1)[:, None] + j  # [P, W]
    factors = np.where(j < c_flat[:, None], 1.0 - k / i.astype(np.float64), 1.0)
    estimate = 1.0 - np.prod(factors, axis=1)
    # n − c < k: every k-subset contains a correct sample (the product would pass through 0).
    estimate = np.where(n_flat - c_flat < k, 1.0, estimate)
    return estimate.reshape(n.shape)
