"""Paired comparisons over seeds for benchmarks/noise_study.py: a t-interval over the seeds' paired
differences, and a bootstrap over seeds and problems for held-out figures computed from per-problem
counts. Functions of plain lists; nothing here runs a model.

Paired: run s of every arm has seed s (the same prompt order, the same held-out problems), so the
unit of comparison is the seed's difference d_s = X_A,s − X_B,s, not two independent means.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence

# t_{0.975, df} for df = 1..30 (two-sided 95%); beyond 30 the normal's 1.96 is within 2%
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (two-sided 95% intervals)."""
    if df < 1:
        raise ValueError(f"t975: df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def t_interval(differences: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean paired difference over seeds and its 95% t-interval
    mean ± t_{0.975, n−1} · sd / √n (one seed: the interval is unbounded)."""
    n = len(differences)
    if n == 0:
        raise ValueError("t_interval: no paired differences")
    mean = statistics.fmean(differences)
    if n == 1:
        return mean, -math.inf, math.inf
    half = t975(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half


def mean_pass_at_k(n: int, counts: Sequence[int], k: int) -> float:
    """pass@k over problems from each problem's count of correct samples out of n (the project's
    unbiased estimator, algorithms/pass_at_k.py)."""
    from threepo.algorithms.pass_at_k import pass_at_k

    return float(pass_at_k([n] * len(counts), list(counts), k).mean())


def zero_advantage_chance(n: int, c: int, group: int) -> float:
    """The chance that `group` of the n samples of a problem, c of them correct, drawn without
    replacement, are all wrong or all right: a group GRPO learns nothing from."""
    if not 1 <= group <= n:
        raise ValueError(f"zero_advantage_chance: expected 1 <= group <= n={n}, got {group}")
    return (math.comb(n - c, group) + math.comb(c, group)) / math.comb(n, group)


def bootstrap_interval(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                       statistic: Callable[[Sequence[int]], float], *, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean over seeds of statistic(a_s) − statistic(b_s), where a_s and b_s
    are seed s's per-problem counts in the two arms (the same problems in the same order), and its
    95% percentile interval over `resamples` draws that resample the seeds and, within each drawn
    seed, the problems (the same problem indices in both arms: the pairing is kept)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"bootstrap_interval: expected the same seeds in both arms, got {len(a)} and {len(b)}")
    if any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError("bootstrap_interval: a seed's problems differ between the arms")
    mean = statistics.fmean(statistic(x) - statistic(y) for x, y in zip(a, b))
    rng, draws = random.Random(seed), []
    for _ in range(resamples):
        total = 0.0
        for s in (rng.randrange(len(a)) for _ in a):
            index = [rng.randrange(len(a[s])) for _ in a[s]]
            total += statistic([a[s][i] for i in index]) - statistic([b[s][i] for i in index])
        draws.append(total / len(a))
    draws.sort()
    return mean, draws[int(0.025 * resamples)], draws[min(resamples - 1, int(0.975 * resamples))]
