"""The driver: `run(cfg)` is the one loop that schedules every role. Read this file first.

Schedule of the loop, top to bottom: admit prompts under the staleness bound and send each chunk of
rollout requests to a sampler and, by reference, straight on to a verifier → when a step's worth of
groups is complete, hand the learner the groups' rows (references to the batches, never the data):
when it is free, or (async) to wait in its queue behind the step it is running, so it never waits for
the driver → wait for whatever finishes next: a scored batch joins its groups (or its requests are
generated again), a learner result is logged and, when it says so, the version it returned goes to
the posterior server (no call of its own); the mean is evaluated or a checkpoint started (no step is
queued past those), a new version's plan replaces the current one, an evaluation or a checkpoint
completes. The synchronous mode is the same loop with the admission rule that waits for each step.

Completions never pass through the driver: a sampler's `CompletionBatch` goes from the object store
to a verifier and to the learner; the driver reads the small `GenerateReport` and `ScoreBatch` and
keeps ids, counts and row positions in its `Ledger` (services/ledger/ledger.py, a plain class with its
own tests). The loop's own waiting is here: every reference it waits on maps to a typed event (`Scored`,
`Learned`, `Published`, `Evaluated`, `Saved`, `Joined`; deploy/driver_state.py, with the `Loop` state),
handled in one `match`. The roles' start-up and calls that complete before the loop goes on live in
deploy/actors.py, learner_actor.py, learner_group.py, cluster.py, limiter.py and checkpoints.py;
version lifetime is the ledger's (`Ledger.adopt`); summary.json is written by deploy/outputs.py.
"""

from __future__ import annotations

import os
import time

import ray

from threepo.deploy import checkpoints
from threepo.deploy.actors import Roles, start_roles, start_stateful, stop_roles
from threepo.deploy.cluster import init_ray
from threepo.deploy.config import RunConfig
from threepo.deploy.cores import CorePlacement
from threepo.deploy.driver_state import Call, Evaluated, Joined, Learned, Loop, Published, Saved, Scored
from threepo.deploy.outputs import (RunLog, Window, delivery_figures, record_driver_metrics, resume_metrics_file,
                                    write_summary)
from threepo.services.ledger.ledger import Ledger, PersistentFailure, Readmission
from threepo.services.ledger.stream import PromptStream
from threepo.services.tasks.datasets import train_items
from threepo.services.verifiers.base import VerifierOutage

_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class RoleLost(RuntimeError):
    """The learner or the posterior server died; `train` restores both from the latest checkpoint."""


class RunStopped(RuntimeError):
    """The run stopped for a reason waiting cannot fix (every verifier endpoint down past
    `sandbox.outage_s`, a request failing past `runtime.max_reissues`, restores used up); the
    message says why and how to resume, summary.json where it stopped."""


def train(cfg: RunConfig, run_dir: str, policy_path: str, resume_from: str | None = None) -> dict:
    """Start the roles (the learner and posterior restored from `resume_from` if given), run the loop,
    stop the roles. A dead learner or posterior server is restored from the latest checkpoint, at
    most `runtime.max_restores` times."""
    init_ray(cfg)
    cores = CorePlacement(cfg)  # the driver's cores now, before the learner is placed (again after a restore)
    roles = start_roles(cfg, policy_path, run_dir, checkpoint=resume_from, cores=cores)
    for line in cores.lines():
        print(f"threepo: {line}")
    try:
        for restore in range(cfg.runtime.max_restores + 1):
            try:
                if cores.cores:  # the learner's process on cores of its own (again after a restore)
                    cores.place(call(roles.learner.process_id.remote()))
                return run(cfg, run_dir, roles, resume_from)
            except RoleLost as lost:
                resume_from = checkpoints.latest_or_none(run_dir)
                if restore == cfg.runtime.max_restores:
                    raise RunStopped(f"{lost}; restored {restore} times already (runtime.max_restores): resume "
                                     f"with `threepo train --resume {run_dir}`") from None
                print(f"train: {lost}; restoring from {resume_from or 'the start'}")
                start_stateful(roles, cfg, policy_path, run_dir, resume_from, cores)
    finally:
        cores.release()
        stop_roles(roles)


def run(cfg: RunConfig, run_dir: str, roles: Roles, resume_from: str | None = None) -> dict:
    """The driver loop: `cfg.runtime.steps` learner steps; returns the summary (delivery counts)."""
    rt = cfg.runtime
    ledger = Ledger(PromptStream(train_items(cfg.data, cfg.task), cfg.seed), prompts_per_step=rt.prompts_per_step,
                    max_offpolicy=rt.max_offpolicy, total_steps=rt.steps, mode=rt.mode,
                    max_reissues=rt.max_reissues, requests_per_call=rt.requests_per_call,
                    readmission=Readmission.of(cfg.algo))
    if resume_from:  # the learner and posterior restored themselves; the ledger and metrics follow
        saved = checkpoints.load_driver(resume_from)
        ledger.load(saved["ledger"])
        resume_metrics_file(os.path.join(run_dir, "metrics.jsonl"), saved["metrics_bytes"], ledger.step)
    elif os.path.exists(os.path.join(run_dir, "metrics.jsonl")):  # a restore before the first checkpoint
        resume_metrics_file(os.path.join(run_dir, "metrics.jsonl"), 0, 0)
    s = Loop(cfg, roles, ledger, RunLog(run_dir, cfg, ledger.step))
    if resume_from:
        current = call(s.roles.posterior.current_version.remote())
        s.roles.posterior.acquire.remote(current)  # the ledger's hold (Ledger.adopt)
        adopt(s, call(s.roles.posterior.version_plan.remote(current)))
    else:
        publish_start(s)
    try:
        while ledger.step < rt.steps or s.learning:
            # 1. admit prompts: each chunk goes to a sampler and, by reference, straight on to a verifier
            admitted = ledger.admit(learner_busy=bool(s.learning), queued=max(0, len(s.learning) - 1))
            if admitted:
                s.roles.posterior.acquire.remote(ledger.version, len({r.group_id for r in admitted}))
                dispatch(s, admitted)
            # 2. train when a step's worth of groups is complete and the learner is free, or queue the
            #    step behind the running one
            if ledger.ready() >= ledger.groups_per_step() and may_learn(s):
                learn(s)
            # 3. wait for whatever finishes next and route it on
            elastic = rt.elastic
            if elastic and not poll_pool(s):
                continue  # no sampler capacity in the cluster yet: waited for a node
            if not s.inflight:
                raise RuntimeError(f"driver stalled at step {ledger.step}: nothing in flight, "
                                   f"{ledger.ready()} groups ready of {ledger.groups_per_step()} needed")
            done, _ = ray.wait(list(s.inflight), num_returns=1, timeout=rt.pool_check_s if elastic else None)
            if not done:
                continue
            done = done[0]
            match s.inflight.pop(done):
                case Joined(sampler):
                    joined(s, done, sampler)
                case Scored(c):
                    on_scored(s, done, c)
                case Learned():
                    on_learned(s, done, run_dir)
                case Published(weights):
                    adopt(s, call(done), weights)
                case Evaluated(step):
                    s.log.heldout(step, *ray.get(done))
                case Saved():
                    on_saved(s, done, run_dir)
        finish_checkpoint(s, run_dir)
    except (PersistentFailure, VerifierOutage) as err:
        stop_checkpoint(s, run_dir)
        write_summary(s, run_dir, stopped=str(err))
        raise RunStopped(f"stopped at step {ledger.step}: {err}; resume with `threepo train --resume {run_dir}`") from None
    final = call(s.roles.learner.save_hf.remote(os.path.join(run_dir, "final")))
    return write_summary(s, run_dir, final_checkpoint=final)


def publish_start(s: Loop) -> None:
    """Version 0, the learner's start, published with the ledger's hold (in a function of its own: a
    reference to it held in `run` would keep its weights in the object store for the whole run)."""
    start = s.roles.learner.published.remote("start")
    adopt(s, call(s.roles.posterior.publish.remote(start, True)), start)


def dispatch(s: Loop, requests: list) -> None:
    """Send requests to live samplers (one call per routed chunk, carrying a reference to its
    version's weights) and each call's batch, by reference, on to a verifier. With no sampler alive
    (an elastic pool between nodes) they wait in the backlog."""
    live = [i for i, handle in enumerate(s.roles.samplers) if handle is not None and i not in s.joining]
    requests, s.backlog = s.backlog + list(requests), []
    if not live:
        s.backlog = requests
        return
    for sampler, chunk in s.ledger.route(requests, live):
        weights = s.weights[chunk[0].policy_version]
        report, batch = s.roles.samplers[sampler].generate.remote(chunk, [weights])
        s.inflight[verifier(s).score.remote(batch)] = Scored(Call(sampler, chunk, report, batch))


def poll_pool(s: Loop) -> bool:
    """Elastic pool, once per `runtime.pool_check_s`: start a sampler for every unit of sampler
    capacity the cluster offers beyond the live ones; it joins the routing once it answers (and
    loads the current version with its first request). With nothing in flight (no sampler capacity
    yet) it waits one period for a node and returns False: the loop goes round again."""
    rt = s.cfg.runtime
    if time.monotonic() - s.pool_checked >= rt.pool_check_s:
        grow_pool(s)
    if not s.inflight:
        time.sleep(rt.pool_check_s)
        return False
    return True


def grow_pool(s: Loop) -> None:
    """Start a sampler for every unit of sampler capacity the cluster offers beyond the live ones."""
    from threepo.deploy.actors import start_sampler

    rt = s.cfg.runtime
    s.pool_checked = time.monotonic()
    capacity = int(ray.cluster_resources().get(rt.sampler_resource, 0))
    for _ in range(capacity - sum(h is not None for h in s.roles.samplers)):
        index = len(s.roles.samplers)
        handle = start_sampler(s.cfg, s.roles.policy_path, s.roles.run_dir, index)
        s.roles.samplers.append(handle)
        s.joining.add(index)
        s.inflight[handle.stats.remote()] = Joined(index)


def joined(s: Loop, done, index: int) -> None:
    """A new or restarted sampler answered: route to it from now on. One still restarting is asked
    again (Ray fails a call to it after ~2 s), for at most `runtime.sampler_restart_s`; one that is
    gone for good is dropped."""
    s.joining.discard(index)
    try:
        ray.get(done)
        s.restarting.pop(index, None)
    except ray.exceptions.ActorUnavailableError:
        if not s.cfg.runtime.elastic:
            waited, limit = time.monotonic() - s.restarting.get(index, time.monotonic()), s.cfg.runtime.sampler_restart_s
            if waited > limit:
                raise PersistentFailure(f"sampler {index} has been restarting for {waited:.0f} s "
                                        f"(runtime.sampler_restart_s={limit:g})") from None
            rejoin(s, index)
            return
        s.roles.samplers[index] = None
    except _DEAD:
        s.roles.samplers[index] = None
    dispatch(s, [])


def rejoin(s: Loop, index: int) -> None:
    """Route around sampler `index` (fixed pool, being restarted by Ray) until it answers again:
    requests sent to it meanwhile would fail without running and spend their re-issues."""
    s.restarting.setdefault(index, time.monotonic())
    if index not in s.joining:
        s.joining.add(index)
        s.inflight[s.roles.samplers[index].stats.remote()] = Joined(index)


def verifier(s: Loop):
    s.verifier_turn += 1
    return s.roles.verifiers[s.verifier_turn % len(s.roles.verifiers)]


def on_scored(s: Loop, done, c: Call) -> None:
    """A scored batch joins its groups; a dead sampler's or a refused request is generated again."""
    try:
        report = ray.get(c.report)
    except _DEAD:
        if s.cfg.runtime.elastic:  # its node left, it is not coming back
            s.roles.samplers[c.sampler] = None
        elif s.roles.samplers[c.sampler] is not None:  # fixed pool: Ray restarts it
            rejoin(s, c.sampler)
        dispatch(s, s.ledger.lost(c.requests, sampler=True))  # a restarted sampler loads the version itself
        return
    try:
        scores = ray.get(done)
    except _DEAD:  # the verifier died: score the same batch again, elsewhere (bounded)
        s.ledger.verifier_failed()
        c.verifier_attempts += 1
        if c.verifier_attempts > s.cfg.runtime.max_reissues:
            raise PersistentFailure(f"verifiers died {c.verifier_attempts - 1} times on one batch") from None
        s.inflight[verifier(s).score.remote(c.batch)] = Scored(c)
        return
    s.restarts.observe("sampler", c.sampler, report.incarnation)
    key, s.next_key = s.next_key, s.next_key + 1
    redo = s.ledger.arrived(key, report, scores)
    for v, n in s.ledger.arrived_holds().items():  # complete groups need their version's weights no more
        s.roles.posterior.release.remote(v, n)
    if not s.ledger.drop_unused(key):
        s.batches[key] = (c.batch, done)
    s.window.generate_s[report.engine_id] += report.generate_s
    s.window.tokens[report.engine_id] += report.tokens
    s.window.verify_s += scores.verify_s
    dispatch(s, redo)


def may_learn(s: Loop) -> bool:
    """May the next step go to the learner now? When it is free; and (async) while one step runs,
    to wait in the learner's queue, so the learner never waits for the driver between steps — unless
    the running step is followed by an evaluation or a checkpoint, which must see exactly the state
    after it (a queued step would run first)."""
    if not s.learning:
        return True
    running, rt = s.learning[0][0], s.cfg.runtime
    return (len(s.learning) == 1 and rt.mode == "async" and not evaluates_after(s, running)
            and not checkpoints_after(s, running))


def evaluates_after(s: Loop, step: int) -> bool:
    return s.roles.evaluator is not None and step % s.cfg.runtime.eval_every == 0


def checkpoints_after(s: Loop, step: int) -> bool:
    rt = s.cfg.runtime
    return rt.checkpoint_every != "end" and step % rt.checkpoint_every == 0 and step < rt.steps


def learn(s: Loop) -> None:
    """Hand the learner the next step's groups: row positions and references to their batches."""
    groups, keys, drop = s.ledger.take()
    batch_refs, score_refs = zip(*(s.batches[k] for k in keys))
    result, version = s.roles.learner.step.remote(groups, len(keys), *batch_refs, *score_refs)
    s.inflight[result] = Learned()
    s.learning.append((s.ledger.step, result, version))
    for k in drop:  # the step's task holds its own references from here on
        del s.batches[k]
    if s.idle_since is not None:
        s.window.learner_wait_s += time.monotonic() - s.idle_since
        s.idle_since = None


def on_learned(s: Loop, done, run_dir: str) -> None:
    """Take the learner's results up to `done` in step order (ray.wait may report a queued step's
    result before the one ahead of it, though the learner ran them in order)."""
    while s.learning:
        step, ref, version = s.learning.pop(0)
        s.inflight.pop(ref, None)
        learned(s, step, call(ref), version, run_dir)
        if ref == done:
            return


def learned(s: Loop, step: int, result, version, run_dir: str) -> None:
    """Log the step; publish the version it returned when it says so; evaluate and checkpoint as
    the step numbers say (queued on the learner, behind nothing: see `may_learn`)."""
    learner = s.roles.learner
    if result.step != step:
        raise RuntimeError(f"learner result of step {result.step} where step {step} was expected")
    if not s.learning:
        s.idle_since = time.monotonic()
    if result.publish:
        s.inflight[s.roles.posterior.publish.remote(version, True)] = Published(version)
    if evaluates_after(s, result.step):
        s.inflight[s.roles.evaluator.evaluate.remote(learner.published.remote("eval"))] = Evaluated(result.step)
    row = {"step": result.step, "time_s": round(s.log.elapsed(), 3), "version": s.ledger.version,
           **result.metrics, **s.window.figures(result.metrics["step_time_s"]), **delivery_figures(s),
           "sync_event": result.publish, "sync_reason": result.publish_reason, "learner_queued": len(s.learning)}
    s.window = Window()
    record_driver_metrics(s.log.metrics, row, s.ledger.counts, s.reported)
    s.log.metrics["threepo_actor_restarts_total"].inc(s.restarts.take("sampler"), role="sampler")
    s.log.step(row)
    if checkpoints_after(s, result.step) and not s.pending:
        s.pending = checkpoints.begin(s.roles, s.ledger, run_dir, s.log.offset())
        s.inflight.update({ref: Saved() for ref in s.pending.waiting})


def on_saved(s: Loop, done, run_dir: str) -> None:
    call(done)
    s.pending.waiting.discard(done)
    if not s.pending.waiting:
        checkpoints.commit(s.pending, run_dir, s.cfg.runtime.keep_checkpoints)
        s.pending = None


def finish_checkpoint(s: Loop, run_dir: str) -> None:
    """The end of the run: let a checkpoint in progress commit, take in the last evaluations and
    version, then write the final checkpoint."""
    for ref in list(s.pending.waiting) if s.pending else ():
        on_saved(s, ref, run_dir)
        s.inflight.pop(ref, None)
    for ref, event in list(s.inflight.items()):
        match event:
            case Evaluated(step):  # the last evaluations belong in the record
                s.log.heldout(step, *ray.get(ref))
            case Published(weights):  # and the last version in the summary
                adopt(s, call(ref), weights)
    s.pending = checkpoints.begin(s.roles, s.ledger, run_dir, s.log.offset())
    for ref in list(s.pending.waiting):
        on_saved(s, ref, run_dir)


def stop_checkpoint(s: Loop, run_dir: str) -> None:
    """A run that stops keeps its work: the steps in progress finish, then a checkpoint is written
    (the roles stay alive: a stop is the rest of the system's fault, not theirs)."""
    if s.learning:
        on_learned(s, s.learning[-1][1], run_dir)
    finish_checkpoint(s, run_dir)


def adopt(s: Loop, published, weights=None) -> None:
    """A new version (VersionPlan from the posterior server, published with a hold): the ledger,
    the one owner of version lifetime, adopts it or not and says which holds to release; the driver
    releases them on the server and keeps a weights reference for each version the ledger says is
    live. Samplers fetch a version's weights by reference when they first serve it — the learner's
    own published object (`weights`, whose arrays the posterior server keeps too: one copy), or
    after a restore the server's."""
    for version in s.ledger.adopt(published):
        s.roles.posterior.release.remote(version)
    if s.ledger.version != published.version:
        return  # overtaken by a newer one: not adopted
    s.weights[published.version] = weights if weights is not None else s.roles.posterior.weights.remote(
        published.version)
    live = s.ledger.live_versions()
    s.weights = {v: ref for v, ref in s.weights.items() if v in live}


def call(ref):
    """ray.get of a learner or posterior call: a dead one is `RoleLost` (train restores both)."""
    try:
        return ray.get(ref)
    except _DEAD as err:
        raise RoleLost(f"the learner or posterior server died ({type(err).__name__})") from None
