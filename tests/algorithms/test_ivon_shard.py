"""IVON sharded by name (algorithms/ivon_shard.py): the owner map by hand and its invariants, and the
decomposition itself — two "ranks" in one process, each with its own model copy, stepping only the
tensors it owns on gradients summed from the two halves of a batch, end where one IVON ends."""

from __future__ import annotations

import pytest
import torch

from threepo.algorithms.ivon import IVON
from threepo.algorithms.ivon_shard import shard_by_numel, shard_loads


def test_owner_map_by_hand():
    # largest first to the least-loaded rank: a(10)->0; b(6)->1; c(5)->1 (6 < 10); d(4)->0 (10 < 11)
    numels = [("a", 10), ("b", 6), ("c", 5), ("d", 4)]
    owner = shard_by_numel(numels, 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert list(owner) == ["a", "b", "c", "d"]  # in the given order
    assert shard_loads(owner, numels, 2) == [14, 11]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_every_rank_owns_a_balanced_share(ranks):
    gen = torch.Generator().manual_seed(ranks)
    numels = [(f"t{i}", int(n)) for i, n in enumerate(torch.randint(1, 5000, (23,), generator=gen))]
    owner = shard_by_numel(numels, ranks)
    loads = shard_loads(owner, numels, ranks)
    assert set(owner.values()) == set(range(ranks)) and sum(loads) == sum(n for _, n in numels)
    assert max(loads) - sum(loads) / ranks <= max(n for _, n in numels)
    assert shard_by_numel(numels, ranks) == owner  # deterministic


def test_owner_map_rejects_what_cannot_be_sharded():
    with pytest.raises(ValueError, match="at least one"):
        shard_by_numel([("a", 1)], 2)
    with pytest.raises(ValueError, match="unique"):
        shard_by_numel([("a", 1), ("a", 2)], 1)
    with pytest.raises(ValueError, match=">= 1"):
        shard_by_numel([("a", 1)], 0)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _loss(model, x, y, n_total):  # token-mean style: the denominator is the whole batch's
    return ((model(x) - y) ** 2).sum() / n_total


def test_two_sharded_ranks_take_the_step_of_one_ivon():
    x, y = torch.randn(12, 5, generator=torch.Generator().manual_seed(1)), torch.randn(12, 3)
    hyper = dict(lr=0.5, ess=50.0, hess_init=0.3, weight_decay=1e-3, clip_radius=1.0)
    one_model = _model(0)
    one = IVON(list(one_model.named_parameters()), **hyper)
    models = [_model(0), _model(0)]
    named = [list(m.named_parameters()) for m in models]
    owner = shard_by_numel([(n, p.numel()) for n, p in named[0]], 2)
    shards = [IVON([(n, p) for n, p in named[r] if owner[n] == r], **hyper) for r in (0, 1)]

    def broadcast():  # every tensor from its owner
        with torch.no_grad():
            for i, (n, _) in enumerate(named[0]):
                for r in (0, 1):
                    named[r][i][1].copy_(named[owner[n]][i][1])

    for step, seeds in enumerate([[11], [12, 13]]):  # K = 1, then K = 2 Monte-Carlo samples
        for seed in seeds:
            with one.sampled_params(seed):
                _loss(one_model, x, y, 12).backward()
            contexts = [s.sampled_params(seed) for s in shards]
            for c in contexts:
                c.__enter__()
            broadcast()
            halves = [(x[:5], y[:5]), (x[5:], y[5:])]
            for r in (0, 1):
                _loss(models[r], *halves[r], 12).backward()
            for i in range(len(named[0])):  # the collective: Σ_r ∇L_r on every rank
                total = named[0][i][1].grad + named[1][i][1].grad
                for r in (0, 1):
                    named[r][i][1].grad = total.clone()
            for c in contexts:
                c.__exit__(None, None, None)
            broadcast()
            for m in models:
                m.zero_grad(set_to_none=True)
        one.step()
        for s in shards:
            s.step()
        broadcast()
        for n, p in one_model.named_parameters():
            r = owner[n]
            for kind in ("mean", "hess", "momentum"):
                torch.testing.assert_close(shards[r].state[n][kind], one.state[n][kind], rtol=1e-5, atol=1e-7)
            for q in (dict(named[0])[n], dict(named[1])[n]):
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
        assert step == 0 or one.state["0.weight"]["hess"].sub(hyper["hess_init"]).abs().max() > 0
