"""The learner ranks without a process group: which rows a rank computes, the [learner] config and
the combinations it refuses (the collectives themselves: tests/integration/test_learner_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from threepo.deploy.config import ConfigError, load_config
from threepo.services.learner.ranks import SingleRank, share_of


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_row_is_computed_by_one_rank_in_whole_groups(world):
    rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23, 4, 5, 6, 7])  # 4 groups of 4, any order
    shares = [share_of(rows, 4, r, world) for r in range(world)]
    assert sorted(torch.cat(shares).tolist()) == sorted(rows.tolist())
    groups = [set((s // 4).tolist()) for s in shares]
    assert all(len(s) == 4 * len(g) for s, g in zip(shares, groups))  # whole groups
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert share_of(rows, 4, 0, world).tolist() == rows[: 4 * len(groups[0])].tolist()  # the first groups seen


def test_more_ranks_than_groups_leave_some_idle():
    rows = torch.arange(8)
    assert [len(share_of(rows, 4, r, 3)) for r in range(3)] == [4, 4, 0]


def test_one_rank_alone_owns_and_computes_everything():
    alone, rows = SingleRank(), torch.tensor([3, 1, 2])
    assert alone.mine(rows, 2) is rows and alone.own([("a", 1)]) == [("a", 1)] and alone.denominators(rows) == {}
    assert alone.point_metrics([(3.0, {"loss": 1.0}), (1.0, {"loss": 3.0})]) == {"loss": 2.0}


@pytest.mark.parametrize("overrides,key", [
    (["learner.ranks=0"], "learner.ranks"),
    (["learner.deepspeed_stage=4"], "learner.deepspeed_stage"),
    (["learner.deepspeed_stage=2"], "learner.deepspeed_stage"),  # with IVON
    (["learner.ranks=2", "algo.loss=kl_cov"], "algo.loss=kl_cov"),
    (["learner.ranks=2", "algo.vp2o=true", "model.kind=moe"], "algo.vp2o"),
    (["learner.backend=nccl"], "learner.backend=nccl"),
    (["learner.timeout_s=0"], "learner.timeout_s"),
])
def test_learner_config_refuses_what_the_ranks_cannot_do(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_learner_config_resolves_the_backend_from_the_device():
    cfg = load_config(None, ["learner.ranks=2", "optim.name=adamw", "algo.exploration=none", "algo.n_slots=1",
                             "learner.deepspeed_stage=3"])
    assert cfg.learner.resolved_backend == "gloo" and cfg.learner.grouped
    gpu = load_config(None, ["learner.device=cuda"]).learner
    assert gpu.resolved_backend == "nccl" and not gpu.grouped
