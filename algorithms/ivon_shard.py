"""IVON over R data-parallel ranks with its state sharded by parameter name (algorithms.md §1.2).

Everything in the IVON step is elementwise per parameter tensor, and the noise z(seed, name) is a
function of the seed and the name only (param_noise.py), so the step decomposes exactly:

    local      rank r computes the partial loss L_r of its rows with the *global* denominators
               (losses.aggregate_loss num_tokens / num_seqs), so Σ_r L_r = L of the whole batch
    collective ĝ_k = Σ_r ∇L_r(θ̂_k)            (an all-reduce sum of the gradients, per MC sample k)
    combine    the owner of a tensor folds ĝ_k into its Welford means: ḡ, and the Price term
               mean_k ε_k ⊙ ĝ_k with ε_k = σ ⊙ z(seed_k, name) rebuilt by the owner alone —
               equal to the all-reduced local products because ε_k is the same on every rank —
               then takes the step of §1.2 on its tensors (m, h, g_m stay with it)
    publish    the owner writes θ̂ = m + σ ⊙ z (or m) into its tensors and broadcasts them, so
               every rank's model holds the same θ̂ for the next forward; m and σ reach the
               posterior server from the owners (gathered by rank 0)

Optimizer state per rank is then Σ_{own} 12 bytes per parameter (fp32 m, h, g_m), ≈ 1/R of the
whole when `shard_by_numel` balances the shards. The model itself (p.data, the broadcast θ̂ or m)
stays whole on every rank. Not here: the collectives (services/learner/ranks.py), the loss.
"""

from __future__ import annotations

from collections.abc import Sequence


def shard_by_numel(numels: Sequence[tuple[str, int]], ranks: int) -> dict[str, int]:
    """Owner rank of every named tensor, balanced by element count (greedy longest-processing-time:
    largest tensor first, to the least-loaded rank, ties to the lower rank and the earlier name).

    Deterministic given (names, numels, ranks), so every rank computes the same map. The largest
    shard exceeds the mean by at most the largest tensor. Raises ValueError for ranks < 1, more
    ranks than tensors (a rank would own nothing to step) or repeated names.
    """
    names = [n for n, _ in numels]
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    if ranks > len(names):
        raise ValueError(f"{ranks} ranks for {len(names)} tensors: every rank must own at least one")
    order = sorted(range(len(numels)), key=lambda i: (-numels[i][1], i))
    load, owner = [0] * ranks, {}
    for i in order:
        r = min(range(ranks), key=lambda k: (load[k], k))
        owner[names[i]] = r
        load[r] += numels[i][1]
    return {n: owner[n] for n in names}


def shard_loads(owner: dict[str, int], numels: Sequence[tuple[str, int]], ranks: int) -> list[int]:
    """Elements owned by each rank under `owner` ([R], sums to the total)."""
    load = [0] * ranks
    for name, n in numels:
        load[owner[name]] += n
    return load
