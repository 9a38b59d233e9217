"""Exploration plans (algorithms.md §2.2, §2.3): slots, seeds, grouping, gradient point."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from threepo.algorithms.exploration import (ExplorationPlan, Slot, gradient_points, make_plan, noise_seed, plan_seed,
                                           update_seed)


def test_grpo_one_clean_slot():
    plan = make_plan("none", version=0, base_seed=1, group_size=8, n_slots=1)
    assert plan.slots == (Slot(0, None),)
    assert (plan.rollouts_per_slot, plan.group_size, plan.groups_per_prompt) == (8, 8, 1)
    assert plan.group_of(0) == 0


def test_b3po_one_seeded_slot():
    plan = make_plan("b3po", version=2, base_seed=1, group_size=16, n_slots=1)
    assert len(plan.slots) == 1 and plan.slots[0].seed == plan_seed(1, 2, "slot0")
    assert (plan.rollouts_per_slot, plan.group_size, plan.groups_per_prompt) == (16, 16, 1)


def test_m3po_equal_compute_and_unconstrained():
    # equal compute: G = 16, M = 4 → 4 rollouts per slot, each slot its own group of 4
    plan = make_plan("m3po", version=0, base_seed=1, group_size=16, n_slots=4)
    assert (plan.rollouts_per_slot, plan.group_size, plan.groups_per_prompt) == (4, 4, 4)
    assert [plan.group_of(i) for i in range(4)] == [0, 1, 2, 3]
    assert plan.rollouts_per_prompt == 16
    # unconstrained: G = 16 per slot, 4 groups of 16, 4× the rollouts
    free = make_plan("m3po", version=0, base_seed=1, group_size=16, n_slots=4, equal_compute=False)
    assert (free.rollouts_per_slot, free.group_size, free.groups_per_prompt) == (16, 16, 4)
    assert free.rollouts_per_prompt == 64
    assert free.slots == plan.slots  # same seeds: only the rollout count differs


def test_c3po_slots_share_one_group_with_distinct_seeds():
    # G = 16, N = 4 → 4 per slot, one group of 16 over all slots
    plan = make_plan("c3po", version=5, base_seed=9, group_size=16, n_slots=4)
    assert (plan.rollouts_per_slot, plan.group_size, plan.groups_per_prompt) == (4, 16, 1)
    assert [plan.group_of(i) for i in range(4)] == [0, 0, 0, 0]
    seeds = [s.seed for s in plan.slots]
    assert seeds == [plan_seed(9, 5, f"slot{i}") for i in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_seeds_depend_on_base_seed_version_and_slot_only():
    a = make_plan("c3po", version=3, base_seed=7, group_size=8, n_slots=2)
    assert a == make_plan("c3po", version=3, base_seed=7, group_size=8, n_slots=2)
    assert a.slots[0].seed != make_plan("c3po", version=4, base_seed=7, group_size=8, n_slots=2).slots[0].seed
    assert a.slots[0].seed != make_plan("c3po", version=3, base_seed=8, group_size=8, n_slots=2).slots[0].seed


def test_seeds_are_stable_across_processes():
    # Python's hash() is salted per process; the plan's seeds must not be
    code = ("from threepo.algorithms.exploration import make_plan; "
            "p = make_plan('c3po', version=3, base_seed=7, group_size=8, n_slots=2); "
            "print([s.seed for s in p.slots])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert len(outs) == 1
    plan = make_plan("c3po", version=3, base_seed=7, group_size=8, n_slots=2)
    assert outs.pop().strip() == f"{[s.seed for s in plan.slots]}"


@pytest.mark.parametrize("kwargs, word", [
    (dict(kind="c3po", group_size=16, n_slots=3), "n_slots=3"),
    (dict(kind="m3po", group_size=10, n_slots=4), "group_size=10"),
    (dict(kind="c3po", group_size=16, n_slots=0), "n_slots"),
    (dict(kind="b3po", group_size=16, n_slots=2), "n_slots"),
    (dict(kind="ppo", group_size=16, n_slots=1), "kind"),
    (dict(kind="c3po", group_size=0, n_slots=1), "group_size"),
    (dict(kind="c3po", group_size=16, n_slots=4, equal_compute=False), "equal_compute"),
])
def test_bad_combinations_raise_naming_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_plan(version=0, base_seed=0, **kwargs)


def test_plan_validates_when_built_by_hand():
    good = make_plan("c3po", version=0, base_seed=0, group_size=8, n_slots=2)
    with pytest.raises(ValueError, match="kind"):
        dataclasses.replace(good, kind="ppo")
    with pytest.raises(ValueError, match="group_size"):
        dataclasses.replace(good, group_size=6)
    with pytest.raises(ValueError, match="slots"):
        dataclasses.replace(good, slots=(Slot(1, 5), Slot(0, 6)))
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(good, slots=(Slot(0, None), Slot(1, 6)))
    with pytest.raises(ValueError, match="slot_index"):
        good.group_of(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.version = 1  # type: ignore[misc]
    assert isinstance(good, ExplorationPlan)


def test_a_scaled_plan_keeps_seeds_and_grouping_and_scales_every_slot():
    plan = make_plan("c3po", version=3, base_seed=1, group_size=8, n_slots=4)
    assert {s.scale for s in plan.slots} == {1.0}  # the posterior server's plans are unscaled
    hot = plan.scaled(2.0)
    assert [s.seed for s in hot.slots] == [s.seed for s in plan.slots] and {s.scale for s in hot.slots} == {2.0}
    assert (hot.group_size, hot.rollouts_per_slot) == (8, 2)
    assert plan.scaled(1.0) == plan and hot.scaled(0.5) == plan
    grpo = make_plan("none", version=0, base_seed=1, group_size=8, n_slots=1)
    assert grpo.scaled(1.0) == grpo
    with pytest.raises(ValueError, match="no noise to scale"):
        grpo.scaled(2.0)
    with pytest.raises(ValueError, match="scales must be > 0"):
        plan.scaled(0.0)
    with pytest.raises(ValueError, match="1 for the mean"):
        dataclasses.replace(grpo, slots=(Slot(0, None, 2.0),))


def test_a_scaled_plan_multiplies_the_scale_its_slots_already_have():
    plan = make_plan("c3po", version=3, base_seed=1, group_size=8, n_slots=4)
    chosen = plan.with_slots([(noise_seed(1, 5, i, 0), 0.25) for i in range(4)])
    assert [s.seed for s in chosen.slots] == [noise_seed(1, 5, i, 0) for i in range(4)]
    assert (chosen.group_size, chosen.rollouts_per_slot, chosen.version) == (8, 2, 3)
    assert {s.scale for s in chosen.scaled(2.0).slots} == {0.5}  # the control's c times the re-admission's
    with pytest.raises(ValueError, match="3 .seed, scale. pairs for a plan of 4 slots"):
        plan.with_slots([(1, 1.0)] * 3)
    with pytest.raises(ValueError, match="scales must be > 0"):
        plan.with_slots([(1, 0.0)] * 4)


def test_noise_seeds_differ_by_step_slot_and_draw_and_are_never_a_plan_or_update_seed():
    seeds = {noise_seed(3, step, slot, draw) for step in range(4) for slot in range(4) for draw in range(4)}
    assert len(seeds) == 64
    plans = {s.seed for v in range(4) for s in make_plan("c3po", version=v, base_seed=3, group_size=8, n_slots=4).slots}
    updates = {update_seed(3, step, u, k) for step in range(4) for u in range(4) for k in range(4)}
    assert not seeds & plans and not seeds & updates


def test_update_seeds_are_fresh_per_step_update_and_sample_and_never_a_slot_seed():
    seeds = {update_seed(3, step, update, sample) for step in range(4) for update in range(3) for sample in range(4)}
    assert len(seeds) == 4 * 3 * 4 and all(0 <= s < 2**63 for s in seeds)
    slots = {s.seed for v in range(4) for s in make_plan("c3po", version=v, base_seed=3, group_size=8, n_slots=4).slots}
    assert not seeds & slots
    assert update_seed(3, 1, 0, 0) != update_seed(4, 1, 0, 0)


def test_gradient_points_of_each_kind():
    slots = [0, 0, 1, 1, 0, 1]
    fresh = update_seed(5, 7, 2, 0)
    for kind in ("b3po", "c3po", "none"):  # none with IVON: IVON's own training rule, rollouts at m
        assert gradient_points(kind, variational=True, base_seed=5, step=7, update=2, slots=slots) == \
            [(fresh, [0, 1, 2, 3, 4, 5])]
    assert gradient_points("none", variational=False, base_seed=5, step=7, update=2, slots=slots) == \
        [(None, [0, 1, 2, 3, 4, 5])]
    # M3PO: one Monte-Carlo sample per slot group, each fresh (K = M samples in one IVON step)
    assert gradient_points("m3po", variational=True, base_seed=5, step=7, update=2, slots=slots) == \
        [(update_seed(5, 7, 2, 0), [0, 1, 4]), (update_seed(5, 7, 2, 1), [2, 3, 5])]
    with pytest.raises(ValueError, match="variational"):
        gradient_points("c3po", variational=False, base_seed=5, step=7, update=2, slots=slots)
