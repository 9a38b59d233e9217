"""The driver: `run(cfg)` is the one loop that schedules every role. Read this file first.

Schedule of the loop, top to bottom: admit prompts under the staleness bound and route each
group's rollouts to the slots of the current exploration plan → consume finished work as a stream
(completions go to a verifier, scored completions into groups) → when the learner is free and a
step's worth of groups is complete, train → on each learner result: log, publish a new version if
the sync budget fired, checkpoint. The synchronous mode is the same loop with the admission rule
that waits for each step to finish (deploy/bookkeeping.py). This is the only place that knows Ray
futures.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import ray

from threepo.deploy.actors import Roles, init_ray, start_roles, stop_roles
from threepo.deploy.bookkeeping import Delivery, GroupAssembler, PromptStream, admission_open
from threepo.deploy.config import RunConfig
from threepo.services.codec import RolloutLog
from threepo.services.messages import RolloutRequest, ScoredCompletion, VerifyRequest, VerifyStatus


@dataclass
class Loop:
    """Everything the driver tracks between iterations (one owner: the driver)."""

    cfg: RunConfig
    roles: Roles
    stream: PromptStream
    assembler: GroupAssembler
    delivery: Delivery = field(default_factory=Delivery)
    step: int = 0
    next_index: int = 0                       # next fresh prompt of the stream
    admitted_prompts: int = 0                 # admission counter of the staleness rule
    readmit: list = field(default_factory=list)    # (prompt index, group indices) to admit again
    open_groups: dict = field(default_factory=dict)  # group id -> (prompt index, group index)
    inflight: dict = field(default_factory=dict)     # ray future -> (kind, payload)
    requests: dict = field(default_factory=dict)     # request id -> RolloutRequest (for re-issue)
    version: int = 0
    plan: object = None
    published_step: dict = field(default_factory=dict)
    sampler_version: list = field(default_factory=list)
    weights_refs: dict = field(default_factory=dict)
    mean_checksums: dict = field(default_factory=dict)   # version -> checksum of its published mean
    tokens_by_engine: dict = field(default_factory=dict)
    learning: bool = False
    verifier_turn: int = 0
    reported: dict = field(default_factory=dict)    # counts already exported to Prometheus
    reissues: dict = field(default_factory=dict)    # request id -> times re-issued


def train(cfg: RunConfig, run_dir: str, policy_path: str, resume_from: str | None = None) -> dict:
    """Start the roles (restored from `resume_from` if given), run the loop, stop the roles."""
    from threepo.deploy import checkpoints

    init_ray(cfg)
    saved = checkpoints.load(resume_from) if resume_from else None
    roles = start_roles(cfg, policy_path, os.path.basename(os.path.abspath(run_dir)),
                        posterior_state=saved and saved["posterior"])
    try:
        return run(cfg, run_dir, roles, saved)
    finally:
        stop_roles(roles)


def run(cfg: RunConfig, run_dir: str, roles: Roles, saved: dict | None = None) -> dict:
    """The driver loop: `cfg.runtime.steps` learner steps; returns delivery counts and the report."""
    from tqdm import tqdm

    from threepo.deploy import checkpoints
    from threepo.deploy.cli import eval_items
    from threepo.deploy.metrics import RayMetrics
    from threepo.deploy.report import make_report
    from threepo.services.metrics import register_catalogue

    rt = cfg.runtime
    s = Loop(cfg, roles, PromptStream(train_items(cfg), cfg.seed), GroupAssembler(),
             sampler_version=[None] * rt.num_samplers)
    metrics = register_catalogue(RayMetrics())  # the driver's own: queues, syncs, rejections
    if saved:  # learner, posterior versions and plans, data cursor, consumed ids come back
        checkpoints.restore_driver(s, saved)
    else:
        publish(s, roles.learner.published.remote("start"))
    groups_per_step = rt.prompts_per_step * s.plan.groups_per_prompt
    heldout = eval_items(cfg)
    log = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    rollouts = RolloutLog(os.path.join(run_dir, "rollouts.log")) if rt.log_rollouts else None
    started, window = time.monotonic(), time.monotonic()
    bar = tqdm(total=rt.steps, initial=s.step, desc=f"train {cfg.algo.exploration}", unit="step")
    while s.step < rt.steps:
        # 1. admit prompts while the staleness bound allows; their rollouts go straight to samplers
        admitted = []
        while admission_open(mode=rt.mode, admitted_prompts=s.admitted_prompts, learner_steps=s.step,
                             learner_busy=s.learning, prompts_per_step=rt.prompts_per_step,
                             max_offpolicy=rt.max_offpolicy, total_steps=rt.steps):
            admitted += admit(s)
        dispatch(s, admitted)
        # 2. train when the learner is free and a step's worth of groups is complete
        if not s.learning and len(s.assembler.ready) >= groups_per_step:
            groups = [g for g, _ in s.assembler.take(groups_per_step)]  # oldest first, in admission order
            s.delivery.consume(groups)
            for g in groups if rollouts else ():
                rollouts.append(g)
            for g in groups:
                s.open_groups.pop(g.group_id)
            s.inflight[roles.learner.step.remote(groups)] = ("learn", groups)
            s.learning = True
        # 3. wait for whatever finishes next and route it on
        if not s.inflight:
            raise RuntimeError(f"driver stalled at step {s.step}: nothing in flight, "
                               f"{len(s.assembler.ready)} groups ready of {groups_per_step} needed")
        done, _ = ray.wait(list(s.inflight), num_returns=1)
        kind, payload = s.inflight.pop(done[0])
        if kind == "generate":
            on_generated(s, done[0], *payload)
        elif kind == "verify":
            on_verified(s, done[0], payload)
        else:
            result = ray.get(done[0])
            s.learning, s.step = False, result.step
            for v in {g.policy_version for g in payload}:
                roles.posterior.release.remote(v, sum(g.policy_version == v for g in payload))
            row = {"step": s.step, "time_s": round(time.monotonic() - started, 3), "version": s.version,
                   **result.metrics, **delivery_metrics(s, time.monotonic() - window)}
            window = time.monotonic()
            s.tokens_by_engine.clear()
            row["sync_event"], row["sync_reason"] = result.publish_version is not None, result.publish_reason
            record_driver_metrics(metrics, s, row)
            if result.publish_version is not None:
                publish(s, roles.learner.published.remote(result.publish_reason))
                row["sync_bytes_per_engine"] = ray.get(roles.posterior.bytes_of.remote(s.version))
            if rt.eval_every and s.step % rt.eval_every == 0:
                row["heldout_pass1"] = ray.get(roles.learner.evaluate_heldout.remote(heldout, cfg.sampler.max_new_tokens))
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix_str(f"reward {row['reward_mean']:.2f} v{s.version} stale {row['staleness_max']:.0f}")
            bar.update(1)
            if rt.checkpoint_every and s.step % rt.checkpoint_every == 0 and s.step < rt.steps:
                checkpoints.save(s, run_dir)
    bar.close()
    checkpoints.save(s, run_dir)
    final_dir = ray.get(roles.learner.save_hf.remote(os.path.join(run_dir, "final")))
    log.close()
    if rollouts:
        rollouts.close()
    summary = {"final_checkpoint": final_dir, "steps": s.step, "version": s.version,
               "admitted_rollouts": s.delivery.admitted_rollouts, "consumed_rollouts": s.delivery.consumed_rollouts,
               "unique_consumed": len(s.delivery.consumed_ids), "duplicates_dropped": s.assembler.duplicates,
               "reissued_requests": s.delivery.reissued_requests, "sampler_failures": s.delivery.sampler_failures,
               "rejected_checksum": s.delivery.rejected_checksum, "infra_errors": s.delivery.infra_errors,
               "seq_gaps": s.delivery.seq_gaps(), "wall_s": round(time.monotonic() - started, 2),
               "report": [str(p) for p in make_report(run_dir)]}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def admit(s: Loop) -> list[RolloutRequest]:
    """Admit one prompt (a re-admission first) under the current plan: one request per slot."""
    if s.readmit:
        index, groups = s.readmit.pop(0)
    else:
        index, groups = s.next_index, None
        s.next_index += 1
    s.admitted_prompts += 1
    item, plan = s.stream[index], s.plan
    requests = []
    for slot in plan.slots:
        g = plan.group_of(slot.index)
        if groups is not None and g not in groups:
            continue  # this group of the prompt was consumed before the checkpoint
        group_id = f"p{index}/g{g}"
        if group_id not in s.open_groups:
            s.open_groups[group_id] = (index, g)
            s.assembler.expect(group_id, item, index, s.version, s.published_step[s.version], plan.group_size)
            s.roles.posterior.acquire.remote(s.version, 1)
        requests.append(RolloutRequest(request_id=f"{group_id}/s{slot.index}", group_id=group_id, item=item,
                                       policy_version=s.version, slot=slot.index, slot_seed=slot.seed,
                                       n=plan.rollouts_per_slot))
    s.delivery.admitted_rollouts += sum(r.n for r in requests)
    return requests


def dispatch(s: Loop, requests: list[RolloutRequest]) -> None:
    """Send requests to samplers, one call per (sampler, version) chunk, preceded by a version update
    where the sampler holds another one. Routing by rollout chunk (prompt × slots + slot) keeps each
    engine on fixed slots when there are at least as many slots as engines (no weight switching, one
    batch per slot) and spreads prompts round-robin otherwise."""
    n = len(s.roles.samplers)
    by_sampler: dict[int, list[RolloutRequest]] = {}
    for r in requests:
        s.requests[r.request_id] = r
        prompt_index = s.open_groups[r.group_id][0]
        by_sampler.setdefault((prompt_index * len(s.plan.slots) + r.slot) % n, []).append(r)
    per_call = s.cfg.runtime.requests_per_call
    for i, batch in by_sampler.items():
        for version in sorted({r.policy_version for r in batch}):
            same = [r for r in batch if r.policy_version == version]
            if s.sampler_version[i] != version:
                s.roles.samplers[i].update.remote(version, s.weights_refs[version])
                s.sampler_version[i] = version
            for k in range(0, len(same), per_call):
                chunk = same[k:k + per_call]
                s.inflight[s.roles.samplers[i].generate.remote(chunk)] = ("generate", (i, chunk))


def on_generated(s: Loop, future, sampler: int, requests: list[RolloutRequest]) -> None:
    """Check a sampler's completions (crash, sequence numbers, weight checks) and send them to a verifier."""
    try:
        incarnation, completions = ray.get(future)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        s.delivery.sampler_failures += 1
        s.sampler_version = [None if i == sampler else v for i, v in enumerate(s.sampler_version)]
        reissue(s, requests)  # the restarted actor gets its version pushed before it serves again
        return
    if completions:
        s.delivery.record_seq(f"{sampler}/{incarnation}", completions[0].seq_no, completions[-1].seq_no)
    good, bad_requests = [], {}
    for c in completions:
        # the engine built the slot from the published mean and its own checks held around the call
        if c.weights_verified and c.mean_checksum == s.mean_checksums.get(c.policy_version):
            good.append(c)
            s.tokens_by_engine[c.engine_id] = s.tokens_by_engine.get(c.engine_id, 0) + len(c.token_ids)
        else:
            s.delivery.rejected_checksum += 1
            bad_requests[c.request_id] = s.requests[c.request_id]
    reissue(s, list(bad_requests.values()))
    send_to_verifier(s, good)


def send_to_verifier(s: Loop, completions: list) -> None:
    if not completions:
        return
    verifier = s.roles.verifiers[s.verifier_turn % len(s.roles.verifiers)]
    s.verifier_turn += 1
    batch = [VerifyRequest(item=s.requests[c.request_id].item, completion=c.text, finish_reason=c.finish_reason)
             for c in completions]
    s.inflight[verifier.verify_batch.remote(batch)] = ("verify", completions)


def on_verified(s: Loop, future, completions: list) -> None:
    """Scored completions join their groups; an infra_error never does: its request is re-issued."""
    try:
        results = ray.get(future)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        send_to_verifier(s, completions)  # verifiers are restartable; scoring is idempotent
        return
    retry = {}
    for c, r in zip(completions, results):
        if r.status is VerifyStatus.INFRA_ERROR:
            s.delivery.infra_errors += 1
            retry[c.request_id] = s.requests[c.request_id]
        else:
            s.assembler.add(ScoredCompletion(completion=c, result=r))
    reissue(s, list(retry.values()))


def reissue(s: Loop, requests: list[RolloutRequest]) -> None:
    """Generate again (same ids: duplicates are dropped by the assembler, so consumption stays exact).
    A request that keeps failing stops the run with the reason instead of looping forever."""
    for r in requests:
        s.reissues[r.request_id] = s.reissues.get(r.request_id, 0) + 1
        if s.reissues[r.request_id] > s.cfg.runtime.max_reissues:
            raise RuntimeError(f"request {r.request_id} failed {s.reissues[r.request_id]} times (sampler crash, "
                               "checksum mismatch or persistent infra_error from its verifier): stopping the run")
    if requests:
        s.delivery.reissued_requests += len(requests)
        dispatch(s, requests)


def publish(s: Loop, version_ref) -> None:
    """Register the learner's new version with the posterior server. The weights go learner ->
    posterior server -> samplers as object refs (never through the driver); each sampler pulls them
    once, at its next request for that version."""
    plan = ray.get(s.roles.posterior.publish.remote(version_ref))
    s.version, s.plan = plan.version, plan
    s.published_step[plan.version] = ray.get(s.roles.posterior.learner_step.remote(plan.version))
    s.weights_refs[plan.version] = s.roles.posterior.weights.remote(plan.version)
    s.mean_checksums[plan.version] = ray.get(s.roles.posterior.mean_checksum.remote(plan.version))
    for old in [v for v in s.weights_refs if v < plan.version - 8]:
        del s.weights_refs[old]


def record_driver_metrics(handles: dict, s: Loop, row: dict) -> None:
    handles["threepo_queue_depth"].set(row["groups_in_flight"], role="sampler")
    handles["threepo_queue_depth"].set(row["groups_ready"], role="learner")
    for reason, count in (("checksum", s.delivery.rejected_checksum), ("duplicate", s.assembler.duplicates)):
        seen = s.reported.get(reason, 0)
        if count > seen:
            handles["threepo_rejected_completions_total"].inc(count - seen, reason=reason)
            s.reported[reason] = count
    if s.delivery.sampler_failures > s.reported.get("restarts", 0):
        handles["threepo_actor_restarts_total"].inc(s.delivery.sampler_failures - s.reported.get("restarts", 0),
                                                   role="sampler")
        s.reported["restarts"] = s.delivery.sampler_failures


def delivery_metrics(s: Loop, window_s: float) -> dict:
    d = s.delivery
    out = {"admitted_rollouts": d.admitted_rollouts, "consumed_rollouts": d.consumed_rollouts,
           "groups_in_flight": len(s.assembler.pending), "groups_ready": len(s.assembler.ready),
           "reissued_requests": d.reissued_requests, "rejected_checksum": d.rejected_checksum}
    for engine, tokens in s.tokens_by_engine.items():
        out[f"tokens_per_s/engine{engine}"] = tokens / max(window_s, 1e-9)
    return out


def train_items(cfg: RunConfig) -> list:
    from threepo.services.datasets import load_dataset
    from threepo.services.tasks import generate_items

    if cfg.data.path:
        return load_dataset(cfg.data.path)
    return generate_items(cfg.task.family, "train", 4096, seed=cfg.task.seed, difficulty=cfg.task.difficulty)


def main_train(args, cfg: RunConfig, resume_dir: str | None) -> int:
    """`threepo train` on a checked config (deploy/cli.py): evaluate, run, evaluate again, report.
    A fresh run directory is made only once the policy exists, and removed if the run fails before
    writing anything; a resumed run keeps its own."""
    import contextlib

    from threepo.deploy import checkpoints
    from threepo.deploy.cli import policy_path, run_directory

    path = policy_path(cfg)
    resume_from = checkpoints.latest(resume_dir) if resume_dir else None
    with contextlib.nullcontext(resume_dir) if resume_dir else run_directory(cfg, "train") as run_dir:
        return _train_and_report(cfg, run_dir, path, resume_from)


def _train_and_report(cfg: RunConfig, run_dir: str, path: str, resume_from: str | None) -> int:
    from threepo.deploy.cli import evaluate_policy

    print(f"train: run directory {run_dir}")
    before = evaluate_policy(cfg, path, label="held-out before")
    summary = train(cfg, run_dir, path, resume_from=resume_from)
    after = evaluate_policy(cfg, summary["final_checkpoint"], label="held-out after")
    print(f"train: held-out before: {before.summary()}")
    print(f"train: held-out after:  {after.summary()}")
    print(f"train: rollouts admitted {summary['admitted_rollouts']}, consumed {summary['consumed_rollouts']} "
          f"(unique {summary['unique_consumed']}); report: {', '.join(summary['report'])}")
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump({"before": before.__dict__, "after": after.__dict__}, f, indent=2)
    return 0
