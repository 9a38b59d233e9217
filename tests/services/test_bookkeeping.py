"""The driver's ledger without Ray: admission under the staleness bound, routing, group assembly from
array batches, duplicates, weight-check and infra_error re-issue (bounded), exactly-once consumption,
consumed prompts as ranges, sequence gaps, and the resume state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from threepo.algorithms.exploration import make_plan
from threepo.services.ledger.ledger import Ledger, PersistentFailure, Readmission, admission_open
from threepo.services.ledger.stream import PromptStream, RangeSet
from threepo.services.posterior import VersionPlan
from threepo.services.wire.batching import INFRA, STATUSES
from threepo.services.wire.messages import GenerateReport, ScoreBatch, TaskItem, VerifyStatus

ITEMS = [TaskItem(uid=str(i), prompt=f"Q: {i}+1= A: ", answer=str(i + 1)) for i in range(50)]
OK = STATUSES.index(VerifyStatus.OK)


def _open(admitted, steps, mode="async", busy=False, max_offpolicy=1, total=10):
    return admission_open(mode=mode, admitted_prompts=admitted, learner_steps=steps, learner_busy=busy,
                          prompts_per_step=4, max_offpolicy=max_offpolicy, total_steps=total)


def test_async_admission_keeps_every_prompt_within_the_staleness_bound():
    # B = 4 prompts per step, max_offpolicy = 1: at learner step 0 prompts 0..7 (steps 0 and 1) may go
    assert [_open(n, 0) for n in range(10)] == [True] * 8 + [False] * 2
    assert _open(8, 1) and not _open(12, 1)
    assert [_open(n, 0, max_offpolicy=0) for n in (3, 4)] == [True, False]  # on-policy: one step ahead only
    assert not _open(40, 9, total=10)  # never admit what the run will not consume


def test_sync_admission_waits_for_the_step_to_finish():
    assert [_open(n, 0, mode="sync") for n in range(5)] == [True] * 4 + [False]
    assert not _open(4, 1, mode="sync", busy=True)  # the learner is still on step 1
    assert _open(4, 1, mode="sync") and not _open(8, 1, mode="sync")


def _ledger(kind="c3po", slots=2, group=4, steps=3, b=2, max_reissues=2):
    ledger = Ledger(PromptStream(ITEMS, seed=0), prompts_per_step=b, max_offpolicy=1, total_steps=steps,
                    mode="async", max_reissues=max_reissues, requests_per_call=3)
    plan = make_plan(kind, version=0, base_seed=1, group_size=group, n_slots=slots, equal_compute=True)
    ledger.publish(VersionPlan(plan, learner_step=0, mean_checksum="m0", reason="start"))
    return ledger


def _report(requests, *, checksum="m0", verified=None, first=0, engine=0, incarnation="a"):
    rows = tuple(r.n for r in requests)
    return GenerateReport(engine_id=engine, incarnation=incarnation, policy_version=requests[0].policy_version,
                          mean_checksum=checksum, request_ids=tuple(r.request_id for r in requests),
                          request_rows=rows, verified=tuple(verified or [True] * len(requests)),
                          first_seq_no=first, rows=sum(rows), tokens=3 * sum(rows), generate_s=0.1)


def _scores(requests, bad_rows=()):
    statuses = np.full(sum(r.n for r in requests), OK, dtype=np.uint8)
    statuses[list(bad_rows)] = INFRA
    return ScoreBatch(statuses=statuses, rewards=np.ones(len(statuses), np.float32), verify_s=0.01)


def test_admission_routing_and_assembly_of_a_c3po_step():
    ledger = _ledger()
    requests = ledger.admit(learner_busy=False)
    assert len(requests) == 2 * 2 * 2  # prompts of steps 0 and 1, two slots each
    assert ledger.counts.admitted_rollouts == 8 * 2
    calls = ledger.route(requests, samplers=["a", "b"])
    assert all(len(reqs) <= 3 for _, reqs in calls)  # requests_per_call
    by_target = {}
    for target, reqs in calls:
        by_target.setdefault(target, set()).update(r.slot for r in reqs)
    assert by_target == {"a": {0}, "b": {1}}  # two slots, two engines: each keeps its slot
    for k, (target, reqs) in enumerate(calls):
        assert ledger.arrived(k, _report(reqs), _scores(reqs)) == []
    assert ledger.ready() == 4
    assert ledger.arrived_holds() == {0: 4} and ledger.arrived_holds() == {}  # four groups complete, read once
    groups, keys, drop = ledger.take()
    assert [g.group_id for g in groups] == ["p0/g0", "p1/g0"]  # oldest admitted first
    assert all(sum(n for _, _, n in g.parts) == 4 for g in groups)
    assert ledger.counts.consumed_rollouts == 8 and ledger.step == 1
    assert set(drop) <= set(keys) and len(keys) == len({k for g in groups for k, _, _ in g.parts})


def test_a_step_queued_behind_the_running_one_does_not_widen_the_staleness_bound():
    # B = 2, max_offpolicy = 1, 4 steps: admission runs up to one step past the step being learned
    ledger = _ledger(steps=4)
    requests = ledger.admit(learner_busy=False)
    for k, (_, reqs) in enumerate(ledger.route(requests, samplers=["a"])):
        ledger.arrived(k, _report(reqs), _scores(reqs))
    ledger.take()  # step 1 runs: prompts of steps 0..2 may be out
    assert ledger.counts.admitted_rollouts == 2 * 2 * 4 and len(ledger.admit(learner_busy=True)) == 2 * 2
    before = ledger.counts.admitted_rollouts
    ledger.take()  # step 2 waits in the learner's queue behind step 1: nothing more may be admitted yet
    assert ledger.admit(learner_busy=True, queued=1) == [] and ledger.counts.admitted_rollouts == before
    assert len(ledger.admit(learner_busy=True)) == 2 * 2  # once step 2 runs, step 3's prompts may go


def test_duplicates_refusals_and_infra_errors():
    ledger = _ledger(kind="none", slots=1, group=4)
    requests = ledger.admit(learner_busy=False)[:2]
    assert ledger.arrived("x", _report(requests), _scores(requests)) == []
    assert ledger.arrived("y", _report(requests), _scores(requests)) == []  # a re-issued copy arrives too
    assert ledger.counts.duplicates == 8
    r = next(iter(ledger.requests.values()))  # a request that has not arrived yet
    # an engine reporting another mean, and one whose own check failed: both generated again
    assert ledger.arrived("z", _report([r], checksum="stale"), _scores([r])) == [r]
    assert ledger.arrived("w", _report([r], verified=[False]), _scores([r])) == [r]
    assert ledger.counts.rejected_weights == 8 and ledger.drop_unused("z")
    with pytest.raises(PersistentFailure, match=r"failed 3 times"):
        ledger.arrived("v", _report([r]), _scores([r], bad_rows=[1]))  # infra_error: the third failure
    assert ledger.counts.infra_errors == 1


def test_a_failure_is_forgotten_once_the_request_arrives():
    ledger = _ledger(kind="none", slots=1, group=4, max_reissues=1)
    r = ledger.admit(learner_busy=False)[0]
    assert ledger.lost([r], sampler=True) == [r] and ledger.counts.sampler_failures == 1
    assert ledger.arrived(0, _report([r]), _scores([r])) == []
    assert r.request_id not in ledger.reissues and ledger.lost([r], sampler=False) == []  # nothing left to redo


def test_consumed_prompts_are_ranges_and_consuming_twice_is_refused():
    s = RangeSet()
    for i in (0, 1, 2, 5, 3, 4, 9):
        s.add(i)
    assert s.ranges == [[0, 6], [9, 10]] and len(s) == 7 and 4 in s and 7 not in s
    with pytest.raises(ValueError):
        s.add(3)


def test_sequence_gaps_are_counted_per_engine_incarnation():
    ledger = _ledger(kind="none", slots=1, group=4)
    requests = ledger.admit(learner_busy=False)
    ledger.arrived(0, _report(requests[:1], first=0), _scores(requests[:1]))
    ledger.arrived(1, _report(requests[1:2], first=10), _scores(requests[1:2]))  # rows 4..9 never arrived
    ledger.arrived(2, _report(requests[2:3], first=0, incarnation="b"), _scores(requests[2:3]))  # a restart
    assert ledger.counts.seq_gaps == 6


def test_resume_state_regenerates_what_was_in_flight_and_counts_stay_exact():
    ledger = _ledger(steps=4)
    requests = ledger.admit(learner_busy=False)
    done = [r for r in requests if r.group_id in ("p0/g0", "p1/g0")]
    ledger.arrived(0, _report(done), _scores(done))
    ledger.take()
    state = ledger.state()
    frozen = json.dumps(state)
    assert state["counts"]["admitted_rollouts"] == state["counts"]["consumed_rollouts"] == 8
    rest = [r for r in requests if r not in done]
    ledger.arrived(1, _report(rest), _scores(rest))
    ledger.take()  # the ledger goes on while the checkpoint is being written
    assert json.dumps(state) == frozen
    restored = _ledger(steps=4)
    restored.load(state)
    again = restored.admit(learner_busy=False)
    assert {r.group_id for r in again} >= {"p2/g0", "p3/g0"}  # in flight at the checkpoint: admitted again
    assert restored.counts.admitted_rollouts == 8 + sum(r.n for r in again)
    assert all(r.group_id not in ("p0/g0", "p1/g0") for r in again)


def test_prompt_stream_is_reproducible_and_covers_every_item():
    items = ITEMS[:7]
    a, b = PromptStream(items, seed=3), PromptStream(items, seed=3)
    first = [a[i].uid for i in range(14)]
    assert first == [b[i].uid for i in range(14)]
    assert sorted(first[:7]) == sorted(it.uid for it in items) == sorted(first[7:])
    assert first[:7] != [PromptStream(items, seed=4)[i].uid for i in range(7)]


# --- dead-group-aware exploration and the dynamic filter ---------------------------------------------
WRONG = STATUSES.index(VerifyStatus.WRONG)


def _rule_ledger(rule, kind="c3po", slots=2, steps=6, b=2):
    ledger = Ledger(PromptStream(ITEMS, seed=0), prompts_per_step=b, max_offpolicy=1, total_steps=steps,
                    mode="async", max_reissues=2, requests_per_call=8, readmission=rule)
    plan = make_plan(kind, version=0, base_seed=1, group_size=4, n_slots=slots, equal_compute=True)
    ledger.publish(VersionPlan(plan, learner_step=0, mean_checksum="m0", reason="start"))
    return ledger


def _arrive(ledger, requests, passed):
    """Every request of `requests` arrives; the first passed[group id] rows of each group pass."""
    left = dict(passed)
    for k, r in enumerate(requests):
        ok = min(r.n, left.get(r.group_id, 0))
        left[r.group_id] = left.get(r.group_id, 0) - ok
        statuses = np.array([OK] * ok + [WRONG] * (r.n - ok), dtype=np.uint8)
        scores = ScoreBatch(statuses=statuses, rewards=(statuses == OK).astype(np.float32), verify_s=0.0)
        assert ledger.arrived((r.request_id, k), _report([r]), scores) == []


def test_a_dead_prompt_comes_back_once_as_a_new_group_with_scaled_slots_and_a_rescue_is_counted():
    ledger = _rule_ledger(Readmission(readmit_fraction=0.5, dead_group_scale=2.0))  # B = 2: one re-admission per step
    first = ledger.admit(learner_busy=False)  # prompts 0..3 (steps 0 and 1)
    _arrive(ledger, first, {"p0/g0": 0, "p1/g0": 1, "p2/g0": 2, "p3/g0": 1})
    assert not ledger.explore  # nothing is re-admitted before the dead round is consumed
    ledger.take()
    assert list(ledger.explore) == [(0, 1, 2.0, True)] and ledger.counts.dead_prompts == 1
    again = ledger.admit(learner_busy=False)  # step 2's prompts: the re-admission takes a fresh prompt's place
    plan = ledger.plan
    assert [r.group_id for r in again][::2] == ["p0/g0/r1", "p4/g0"]
    assert [(r.request_id, r.slot_seed, r.slot_scale) for r in again[:2]] == \
        [("p0/g0/r1/s0", plan.slots[0].seed, 2.0), ("p0/g0/r1/s1", plan.slots[1].seed, 2.0)]
    assert {r.slot_scale for r in again[2:]} == {1.0} and ledger.next_index == 5
    assert ledger.admitted_prompts == 6 and ledger.counts.readmitted_prompts == 1  # counted as an admission
    ledger.take()  # step 1: prompts 2 and 3
    _arrive(ledger, again, {"p0/g0/r1": 1, "p4/g0": 0})
    groups, *_ = ledger.take()
    assert [g.group_id for g in groups] == ["p0/g0/r1", "p4/g0"]
    c = ledger.counts
    assert (c.retried_dead, c.rescued_dead, c.dead_prompts) == (1, 1, 2)
    assert (0, 1) in ledger.consumed_rounds and 0 in ledger.consumed  # each consumed exactly once
    assert list(ledger.explore) == [(4, 1, 2.0, True)]  # p4 died: queued; p0 was re-admitted once (readmit_max 1)
    figures = ledger.exploration_figures()
    assert figures["rescue_rate"] == 1.0 and figures["readmitted_prompts"] == 1


def test_the_readmission_budget_and_solved_prompts():
    ledger = _rule_ledger(Readmission(readmit_fraction=0.5, dead_group_scale=2.0, solved_group_scale=0.5))
    first = ledger.admit(learner_busy=False)
    _arrive(ledger, first, {"p0/g0": 0, "p1/g0": 0, "p2/g0": 4, "p3/g0": 1})  # two dead in step 0, p2 solved
    ledger.take()
    assert list(ledger.explore) == [(0, 1, 2.0, True)] and ledger.counts.readmit_dropped == 1  # queue: one step's budget
    ledger.take()
    assert ledger.counts.readmit_dropped == 2 and ledger.counts.solved_prompts == 1  # p2's queue place was taken
    plain = _rule_ledger(Readmission(readmit_fraction=0.5))  # solved_group_scale 1: all-pass prompts are not re-admitted
    requests = plain.admit(learner_busy=False)
    _arrive(plain, requests, {"p0/g0": 4, "p1/g0": 4})
    plain.take()
    assert not plain.explore and plain.counts.solved_prompts == 2


def test_grpo_retries_a_dead_prompt_at_the_mean():
    ledger = _rule_ledger(Readmission(readmit_fraction=1.0), kind="none", slots=1)
    requests = ledger.admit(learner_busy=False)
    _arrive(ledger, requests, {})
    ledger.take()
    again = ledger.admit(learner_busy=False)
    assert [(r.group_id, r.slot_seed, r.slot_scale) for r in again] == [("p0/g0/r1", None, 1.0), ("p1/g0/r1", None, 1.0)]


def test_the_dynamic_filter_replaces_equal_reward_prompts_within_its_budget():
    ledger = _rule_ledger(Readmission(dynamic_filter=True, filter_replacements=0.5))  # one replacement per learner step
    first = ledger.admit(learner_busy=False)  # prompts 0..3
    _arrive(ledger, first, {"p0/g0": 0, "p1/g0": 1, "p2/g0": 4, "p3/g0": 2})
    assert ledger.counts.dropped_groups == 1 and ledger.ready() == 3  # p0 dropped, p2 over budget: ready
    assert ledger.admitted_prompts == 3
    extra = ledger.admit(learner_busy=False)
    assert {r.group_id for r in extra} == {"p4/g0"}  # the replacement takes p0's place
    groups, keys, drop = ledger.take()
    assert [g.group_id for g in groups] == ["p1/g0", "p2/g0"]
    p0_keys = [k for k in drop if k[0].startswith("p0/")]
    assert len(p0_keys) == 2 and not set(p0_keys) & set(keys)  # its batches are freed, not handed to the learner
    assert 0 in ledger.consumed and ledger.counts.dropped_rollouts == 4
    _arrive(ledger, extra, {"p4/g0": 1})
    groups, *_ = ledger.take()
    assert [g.group_id for g in groups] == ["p3/g0", "p4/g0"]  # step 1 keeps B informative prompts


def test_resume_keeps_rounds_queue_and_consumed_readmissions():
    rule = Readmission(readmit_fraction=0.5, dead_group_scale=2.0)
    ledger = _rule_ledger(rule)
    first = ledger.admit(learner_busy=False)
    _arrive(ledger, first, {"p0/g0": 0, "p1/g0": 1, "p2/g0": 0, "p3/g0": 1})
    ledger.take()  # p0 dead: queued
    ledger.take()  # p2 dead: the queue (one step's budget) is full
    again = ledger.admit(learner_busy=False)  # steps 2 and 3: p0/r1, p4, p5, p6
    assert [r.group_id for r in again][::2] == ["p0/g0/r1", "p4/g0", "p5/g0", "p6/g0"]
    state = json.loads(json.dumps(ledger.state()))
    restored = _rule_ledger(rule)
    restored.load(state)
    redo = restored.admit(learner_busy=False)
    assert [r.request_id for r in redo] == [r.request_id for r in again]  # in flight: the same ids again
    assert [r.slot_scale for r in redo] == [2.0, 2.0] + [1.0] * 6
    _arrive(restored, redo[:4], {"p0/g0/r1": 0, "p4/g0": 1})
    restored.take()
    assert (0, 1) in restored.consumed_rounds and restored.counts.retried_dead == 1
    assert restored.counts.rescued_dead == 0 and list(restored.explore) == []  # dead again; readmit_max 1



def test_the_ledger_owns_version_lifetime_holds_and_live_weights():
    ledger = _ledger()

    def version(v):
        plan = make_plan("c3po", version=v, base_seed=1, group_size=4, n_slots=2, equal_compute=True)
        return VersionPlan(plan, learner_step=v, mean_checksum=f"m{v}", reason="kl")

    assert ledger.adopt(version(0)) == [] and ledger.held == 0  # adopting the current one: nothing to let go
    requests = ledger.admit(learner_busy=False)
    assert {r.policy_version for r in requests} == {0}
    assert ledger.adopt(version(2)) == [0] and ledger.version == 2  # the previous hold goes once 2 is in
    assert ledger.live_versions() == {0, 2}  # requests at 0 are in flight: its weights stay
    assert ledger.adopt(version(1)) == [1] and ledger.version == 2 and ledger.held == 2  # overtaken: not adopted
    for k, (_, reqs) in enumerate(ledger.route(requests, samplers=["a"])):
        ledger.arrived(k, _report(reqs), _scores(reqs))
    assert ledger.live_versions() == {2}  # nothing at 0 in flight any more
