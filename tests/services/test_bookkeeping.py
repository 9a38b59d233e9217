"""The driver's ledger without Ray: admission under the staleness bound, routing, group assembly from
array batches, duplicates, weight-check and infra_error re-issue (bounded), exactly-once consumption,
consumed prompts as ranges, sequence gaps, and the resume state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from threepo.algorithms.exploration import make_plan
from threepo.deploy.bookkeeping import Ledger, PersistentFailure, PromptStream, RangeSet, admission_open
from threepo.services.batching import INFRA, STATUSES
from threepo.services.messages import GenerateReport, ScoreBatch, TaskItem, VerifyStatus
from threepo.services.posterior import VersionPlan

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
    groups, keys, drop, versions = ledger.take()
    assert [g.group_id for g in groups] == ["p0/g0", "p1/g0"]  # oldest admitted first
    assert all(sum(n for _, _, n in g.parts) == 4 for g in groups) and versions == {0: 2}
    assert ledger.counts.consumed_rollouts == 8 and ledger.step == 1
    assert set(drop) <= set(keys) and len(keys) == len({k for g in groups for k, _, _ in g.parts})


def test_duplicates_refusals_and_infra_errors():
    ledger = _ledger(kind="grpo", slots=1, group=4)
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
    ledger = _ledger(kind="grpo", slots=1, group=4, max_reissues=1)
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
    ledger = _ledger(kind="grpo", slots=1, group=4)
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
