"""The driver's rules without Ray: admission under the staleness bound, group assembly, exactly-once."""

from __future__ import annotations

import pytest

from threepo.deploy.bookkeeping import Delivery, GroupAssembler, PromptStream, admission_open
from threepo.services.messages import Completion, ScoredCompletion, TaskItem, VerifyResult, VerifyStatus

ITEM = TaskItem(uid="u", prompt="Q: 1+1= A: ", answer="2")


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


def _scored(group, cid, reward=1.0):
    c = Completion(completion_id=cid, request_id=cid.rsplit("/", 1)[0], group_id=group, slot=0, prompt_uid="u",
                   engine_id=0, seq_no=0, policy_version=0, slot_seed=1, mean_checksum="x", weights_verified=True, prompt_ids=(1,),
                   token_ids=(2,), logprobs=(-0.1,), finish_reason="stop", text="\\boxed{2}")
    return ScoredCompletion(c, VerifyResult(VerifyStatus.OK, reward))


def test_groups_complete_once_and_duplicates_are_dropped():
    asm = GroupAssembler()
    asm.expect("p0/g0", ITEM, 0, 0, 0, size=2)
    asm.expect("p1/g0", ITEM, 1, 0, 0, size=2)
    with pytest.raises(ValueError, match="admitted twice"):
        asm.expect("p0/g0", ITEM, 0, 0, 0, size=2)
    asm.add(_scored("p1/g0", "p1/g0/s0/0"))
    asm.add(_scored("p1/g0", "p1/g0/s0/0"))  # a re-issued request's copy
    asm.add(_scored("p1/g0", "p1/g0/s0/1"))
    asm.add(_scored("p0/g0", "p0/g0/s0/0"))
    asm.add(_scored("p0/g0", "p0/g0/s0/1"))
    asm.add(_scored("p0/g0", "p0/g0/s0/1"))  # after completion: still dropped
    assert asm.duplicates == 2 and len(asm.ready) == 2
    taken = asm.take(2)
    assert [idx for _, idx in taken] == [0, 1]  # oldest admitted first, whatever finished first
    d = Delivery()
    d.consume([g for g, _ in taken])
    assert d.consumed_rollouts == 4
    with pytest.raises(RuntimeError, match="consumed twice"):
        d.consume([taken[0][0]])


def test_sequence_gaps_are_counted_per_engine_incarnation():
    d = Delivery()
    d.record_seq("0/a", 0, 9)
    d.record_seq("0/a", 15, 19)  # 10..14 never arrived
    d.record_seq("0/b", 0, 4)    # a restarted engine starts again at 0: not a gap
    assert d.seq_gaps() == 5


def test_prompt_stream_is_reproducible_and_covers_every_item():
    items = [TaskItem(uid=str(i), prompt=str(i), answer=str(i)) for i in range(7)]
    a, b = PromptStream(items, seed=3), PromptStream(items, seed=3)
    first = [a[i].uid for i in range(14)]
    assert first == [b[i].uid for i in range(14)]
    assert sorted(first[:7]) == sorted(it.uid for it in items) == sorted(first[7:])
    assert first[:7] != [PromptStream(items, seed=4)[i].uid for i in range(7)]
