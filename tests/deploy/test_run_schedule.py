"""The driver's schedule rules without a cluster: when the next learner step may be queued behind the
running one, and the learner's rollout log written behind its steps."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from threepo.deploy.config import load_config
from threepo.deploy.run import may_learn
from threepo.services.wire.batching import group_records, logged_groups
from threepo.services.wire.codec import LogWriter, RolloutLog


def _loop(learning, *overrides, evaluator=True):
    cfg = load_config(None, ["runtime.steps=200", "runtime.eval_every=50", "runtime.checkpoint_every=30",
                             *overrides])
    return SimpleNamespace(cfg=cfg, learning=[(step, f"r{step}", None) for step in learning],
                           roles=SimpleNamespace(evaluator=object() if evaluator else None))


def test_the_next_step_waits_in_the_learner_queue_behind_one_running_step_only():
    assert may_learn(_loop([]))
    assert may_learn(_loop([7]))  # async: step 8 is queued behind step 7
    assert not may_learn(_loop([7, 8]))  # never more than one waiting
    assert not may_learn(_loop([7], "runtime.mode=sync"))


def test_no_step_is_queued_past_an_evaluation_or_a_checkpoint():
    assert not may_learn(_loop([50]))  # step 50 is evaluated: the evaluation must see its state
    assert may_learn(_loop([50], evaluator=False))
    assert not may_learn(_loop([60]))  # a checkpoint after step 60 (checkpoint_every = 30)
    assert may_learn(_loop([60], "runtime.checkpoint_every=end"))
    assert may_learn(_loop([200], "runtime.eval_every=7"))  # no checkpoint after the last step (the final one)


def test_learner_results_are_taken_in_step_order_whatever_order_ray_reports(monkeypatch):
    from threepo.deploy import run

    seen = []
    monkeypatch.setattr(run, "call", lambda ref: f"result of {ref}")
    monkeypatch.setattr(run, "learned", lambda s, step, result, version, run_dir: seen.append((step, result, version)))
    s = SimpleNamespace(learning=[(7, "r7", "v7"), (8, "r8", None)], inflight={"r7": run.Learned()})
    run.on_learned(s, "r8", "run-dir")  # ray.wait reported the queued step 8 first
    assert seen == [(7, "result of r7", "v7"), (8, "result of r8", None)]
    assert s.learning == [] and s.inflight == {}
    s.learning = [(9, "r9", None), (10, "r10", None)]
    run.on_learned(s, "r9", "run-dir")  # in order: step 10 stays in flight
    assert seen[-1][0] == 9 and s.learning == [(10, "r10", None)]


def _batch_parts():
    """One group of two completions as the learner's step receives it (GroupRows, arrays)."""
    from threepo.services.wire.batching import batches_from_groups
    from threepo.services.wire.messages import Completion, Group, ScoredCompletion, TaskItem, VerifyResult, VerifyStatus

    item = TaskItem(uid="p0", prompt="1+1=", answer="2")
    done = tuple(ScoredCompletion(Completion(completion_id=f"p0/g0/{j}", request_id="r0", group_id="p0/g0", slot=0,
                                             prompt_uid="p0", engine_id=0, seq_no=j, policy_version=0, slot_seed=None,
                                             mean_checksum="m", weights_verified=True, prompt_ids=(1, 2),
                                             token_ids=(3, 4 + j), logprobs=(-0.5, -0.25), finish_reason="stop",
                                             text="2"), VerifyResult(VerifyStatus.OK, 1.0)) for j in range(2))
    return batches_from_groups([Group("p0/g0", item, 0, 0, done)])


def test_the_rollout_log_is_written_behind_the_step_and_sized_only_when_written(tmp_path):
    groups, batches, scores = _batch_parts()
    path = os.path.join(tmp_path, "rollouts.log")
    writer = LogWriter(RolloutLog(path))
    for step in (1, 2, 3):
        writer.put(groups, batches, scores, step)
    size = writer.size()  # waits for the three queued steps
    assert size == os.path.getsize(path) > 0
    assert [type(r).__name__ for r in RolloutLog.read(path)] == ["ConsumedStep"] * 3  # arrays, one record a step
    records = list(logged_groups(path))
    assert [g.step for g in records] == [1, 2, 3]
    assert records[0] == group_records(groups, batches, scores, 1)[0]
    writer.close()


def test_a_rollout_log_of_group_records_still_reads_as_groups(tmp_path):
    # a run resumed from a log written before logs kept arrays appends steps behind its Group records
    groups, batches, scores = _batch_parts()
    path = os.path.join(tmp_path, "rollouts.log")
    with RolloutLog(path) as old:
        old.append(group_records(groups, batches, scores, 1)[0])
    writer = LogWriter(RolloutLog(path))
    writer.put(groups, batches, scores, 2)
    writer.close()
    assert [g.step for g in logged_groups(path)] == [1, 2]


def test_a_rollout_log_write_that_failed_is_raised_by_the_next_call(tmp_path):
    groups, batches, scores = _batch_parts()
    writer = LogWriter(RolloutLog(os.path.join(tmp_path, "rollouts.log")))
    writer.log._file.close()  # the file can no longer be written (as a full or vanished disk)
    writer.put(groups, batches, scores, 1)
    with pytest.raises(RuntimeError, match="rollout log"):
        writer.size()
    with pytest.raises(RuntimeError, match="rollout log"):
        writer.put(groups, batches, scores, 2)



def test_a_restarting_sampler_is_routed_around_until_it_answers_again(monkeypatch):
    """Fixed pool: while Ray restarts a sampler, requests sent to it would fail without running and
    spend their re-issues; the driver holds them back and asks the sampler until it answers."""
    import ray

    from threepo.deploy import run

    probes = []

    class Sampler:
        stats = SimpleNamespace(remote=lambda: probes.append(len(probes)) or f"probe{len(probes)}")

    s = SimpleNamespace(cfg=load_config(None, ["runtime.sampler_restart_s=600"]),
                        roles=SimpleNamespace(samplers=[Sampler()]), joining=set(), restarting={}, inflight={}, backlog=[])
    run.rejoin(s, 0)
    run.rejoin(s, 0)  # already waited for: one probe
    assert s.joining == {0} and s.inflight == {"probe1": run.Joined(0)}
    run.dispatch(s, ["request"])
    assert s.backlog == ["request"]  # no live sampler: the request waits, nothing is sent

    def still_restarting(ref):
        raise ray.exceptions.ActorUnavailableError("The actor is restarting.", None)

    monkeypatch.setattr(ray, "get", still_restarting)
    run.joined(s, s.inflight.pop("probe1"), 0)
    assert s.joining == {0} and s.inflight == {"probe2": run.Joined(0)} and s.backlog == ["request"]

    routed = []
    monkeypatch.setattr(ray, "get", lambda ref: {})
    monkeypatch.setattr(run, "dispatch", lambda s, requests: routed.append((set(s.joining), s.backlog)))
    run.joined(s, s.inflight.pop("probe2"), 0)
    assert routed == [(set(), ["request"])]  # live again: the backlog goes out
    assert s.roles.samplers[0] is not None and s.restarting == {}

    monkeypatch.setattr(ray, "get", still_restarting)
    run.rejoin(s, 0)
    s.restarting[0] -= 601  # restarting for longer than runtime.sampler_restart_s: the run stops
    with pytest.raises(run.PersistentFailure, match="sampler 0 has been restarting for 601 s"):
        run.joined(s, s.inflight.pop("probe3"), 0)
    s.restarting.clear()

    def gone(ref):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", gone)
    run.rejoin(s, 0)
    run.joined(s, s.inflight.pop("probe4"), 0)
    assert s.roles.samplers[0] is None and s.joining == set()  # gone for good: dropped
