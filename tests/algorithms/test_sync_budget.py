"""The sync budget (algorithms.md §3.7): publish on KL > κ, ESS fraction < η or staleness."""

from __future__ import annotations

import itertools
import math

import pytest

from threepo.algorithms.sync_budget import SyncDecision, sync_decision

LIMITS = dict(kappa=0.02, eta=0.5, max_staleness=8)


def test_no_sync_inside_the_budget():
    assert sync_decision(kl=0.01, ess_frac=0.9, steps_since_sync=3, **LIMITS) == SyncDecision(False, None)


@pytest.mark.parametrize("kl, ess, steps, reason", [
    (0.03, 0.9, 0, "kl"),            # KL 0.03 > κ 0.02
    (0.01, 0.4, 0, "ess"),           # ESS 0.4 < η 0.5
    (0.01, 0.9, 8, "staleness"),     # 8 ≥ S_max 8
    (0.03, 0.4, 9, "kl"),            # all fire: KL first
    (0.01, 0.4, 9, "ess"),           # ESS before staleness
])
def test_each_reason_and_their_order(kl, ess, steps, reason):
    assert sync_decision(kl=kl, ess_frac=ess, steps_since_sync=steps, **LIMITS) == SyncDecision(True, reason)


def test_thresholds_are_strict_for_kl_and_ess_inclusive_for_staleness():
    # KL = κ and ESS = η do not fire (">" and "<"); steps = S_max − 1 does not, S_max does
    assert not sync_decision(kl=0.02, ess_frac=0.5, steps_since_sync=7, **LIMITS).publish


def test_matches_the_rule_on_a_grid():
    for kl, ess, steps in itertools.product((0.0, 0.02, 0.05), (0.0, 0.5, 1.0), (0, 7, 8, 20)):
        decision = sync_decision(kl=kl, ess_frac=ess, steps_since_sync=steps, **LIMITS)
        assert decision.publish == (kl > 0.02 or ess < 0.5 or steps >= 8)


def test_on_policy_is_max_staleness_one():
    decision = sync_decision(kl=0.0, ess_frac=1.0, steps_since_sync=1, kappa=0.02, eta=0.5, max_staleness=1)
    assert decision == SyncDecision(True, "staleness")


@pytest.mark.parametrize("bad", [
    dict(kl=math.nan), dict(kl=-0.1), dict(ess_frac=math.nan), dict(ess_frac=1.5),
    dict(steps_since_sync=-1), dict(steps_since_sync=1.5), dict(kappa=-1.0), dict(eta=2.0),
    dict(max_staleness=0), dict(max_staleness=True),
])
def test_invalid_arguments_raise_naming_them(bad):
    args = dict(kl=0.0, ess_frac=1.0, steps_since_sync=0, **LIMITS) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        sync_decision(**args)


def test_decision_is_consistent():
    with pytest.raises(ValueError):
        SyncDecision(True, None)
    with pytest.raises(ValueError):
        SyncDecision(False, "kl")
    with pytest.raises(ValueError):
        SyncDecision(True, "mood")
