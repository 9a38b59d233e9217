"""The driver's bookkeeping, without Ray: admission under the staleness bound from the prompt stream
(services/ledger/stream.py), routing to samplers, group assembly, re-issue, delivery accounting and version
lifetime — `Ledger`, owned by the driver and unit-tested directly (tests/services/test_bookkeeping.py).

The rules it enforces:
- admission (staleness bound): prompt number `i` (0-based, admission order) will be consumed by
  learner step ⌊i / B⌋; it may be admitted only while that step is at most `max_offpolicy` steps
  after the step the learner is working towards — admission control, nothing is ever discarded.
  The synchronous mode admits a step's prompts only when the previous step is complete;
- exactly-once: a request's rows enter its group at most once (a re-issued request yields the same
  completion ids; the later copy is counted as a duplicate and dropped), and a group is consumed at
  most once; consumed prompts are kept as index ranges, so the record stays small;
- nothing unscorable reaches the learner: a request whose engine failed a weight check (mean
  checksum different from the published one, or its own load/verify check) or any of whose rows
  came back `infra_error` is generated again, at most `max_reissues` times, then the run stops;
- uninformative prompts (`Readmission`): the ledger sees every group's verifier results as they
  arrive, so when all groups of an admission of a prompt (a round) are complete it knows whether
  every rollout failed (dead), every one passed (solved) or all rewards were equal.
  Dead-group-aware exploration admits a dead (or, if configured, solved) prompt again as a new
  round — group ids `p<i>/g<g>/r<round>`, consumed once like any group — served from the plan with
  every slot's σ multiplied by `dead_group_scale` (`solved_group_scale`), within a budget: at most
  ⌈readmit_fraction · B⌉ re-admissions among the prompts of any step, at most `readmit_max` per prompt, and
  a waiting queue of one step's budget (a dead prompt finding it full is not re-admitted). A
  re-admission is an admission like any other, so it takes the place of a fresh prompt of a later
  step under the same staleness rule. "Rescued" counts the re-admissions of dead prompts in
  which at least one rollout succeeded. The DAPO dynamic filter drops a round whose rewards are
  all equal before the learner takes it and frees its admission, so another prompt (a waiting
  re-admission first, else a fresh one) is consumed by the same step in its place; at most
  ⌈filter_replacements · B⌉ rounds per learner step are dropped, later ones go to the learner, which
  leaves them out of its update (its own filter). Groups are consumed oldest admission first.

The ledger holds ids, counts and (batch key, row) positions only — never completions: batches stay
in the object store under keys the driver maps to references, and the ledger says when a batch is
no longer needed by any group (`take` returns the keys to drop).

Version lifetime has this one owner: the ledger keeps the plan of every version a group in flight
still names, holds one reference on the posterior server to the version it admits at (taken when the
version is published, `adopt` says which to release), counts the references its admissions take
(one a group) and the arrivals that release them (`arrived_holds`: a group whose rollouts have all
arrived needs its version's weights no more, though it may wait steps for the learner), and says
which versions' weights the driver must keep a reference to (`live_versions`). The driver only
mirrors its answers on the server.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Hashable, Sequence

from threepo.services.ledger.parts import (OK, Counts, OpenGroup, OpenRound, PersistentFailure, Readmission,
                                           admission_open, parse_round_key, round_key, route_calls)
from threepo.services.ledger.stream import PromptStream, RangeSet
from threepo.services.posterior import VersionPlan
from threepo.services.wire.batching import INFRA
from threepo.services.wire.messages import GenerateReport, GroupRows, RolloutRequest, ScoreBatch


class Ledger:
    """Admission, routing, assembly and delivery accounting of one run; see the module docstring."""

    def __init__(self, stream: PromptStream, *, prompts_per_step: int, max_offpolicy: int, total_steps: int,
                 mode: str, max_reissues: int, requests_per_call: int, readmission: Readmission = Readmission()) -> None:
        self.stream, self.b, self.max_offpolicy = stream, prompts_per_step, max_offpolicy
        self.total_steps, self.mode, self.max_reissues, self.per_call = total_steps, mode, max_reissues, requests_per_call
        self.rule = readmission
        self.readmit_cap = math.ceil(readmission.readmit_fraction * prompts_per_step)
        self.filter_cap = math.ceil(readmission.filter_replacements * prompts_per_step)
        self.step = 0                 # learner steps consumed
        self.next_index = 0           # next fresh prompt of the stream
        self.admitted_prompts = 0     # admission counter of the staleness rule
        self.admission_no = 0         # admission sequence number (never goes back)
        self.readmit: deque = deque()  # (prompt index, group indices, round, scale, after dead) to admit again (resume)
        self.explore: deque = deque()  # (prompt index, round, scale, after dead): re-admissions waiting
        self._readmits: Counter = Counter()  # step (admission) -> re-admissions among its prompts
        self._rounds: dict[tuple[int, int], OpenRound] = {}  # (prompt index, round) -> open round
        self._filtered: list[str] = []    # ids of groups the dynamic filter dropped, released at the next take
        self._arrived_holds: Counter = Counter()  # version -> groups complete since `arrived_holds` was read
        self._dropped_this_step = 0
        self.consumed_rounds: set = set()  # (prompt index, round ≥ 1) all of whose groups were consumed
        self.version: int | None = None
        self.versions: dict[int, VersionPlan] = {}
        self.held: int | None = None  # the version whose posterior hold this ledger keeps (adopt)
        self.groups: dict[str, OpenGroup] = {}
        self.requests: dict[str, RolloutRequest] = {}  # in flight
        self.reissues: Counter = Counter()
        self._ready: list = []        # heap of (admission order, group index, group id): complete groups, oldest first
        self._batch_refs: Counter = Counter()  # batch key -> parts of open groups that point into it
        self._seq: dict[str, list[int]] = {}   # engine incarnation -> [first, last] sequence number seen
        self._seq_seen: Counter = Counter()
        self.consumed = RangeSet()    # prompt indices all of whose groups were consumed
        self._partial: dict[int, set] = {}  # prompt index -> its consumed group indices (not all yet)
        self.counts = Counts()

    # --- versions and admission -------------------------------------------------------------------
    def publish(self, info: VersionPlan) -> None:
        """A new current version: later admissions use its plan."""
        self.versions[info.version] = info
        self.version = info.version
        live = {g.version for g in self.groups.values()} | {info.version}
        self.versions = {v: i for v, i in self.versions.items() if v in live}

    def adopt(self, info: VersionPlan) -> list[int]:
        """Take in a version the posterior server published with a hold for this ledger (the one
        owner of version lifetime: the driver mirrors its answers on the server). The ledger holds the
        version it admits at until it adopts a newer one, since admissions sent before then still
        name it; a version overtaken by a newer adopted one is not adopted. Returns the versions
        whose hold to release."""
        if self.held is not None and info.version < self.held:
            return [info.version]
        release = [self.held] if self.held is not None and self.held != info.version else []
        self.held = info.version
        self.publish(info)
        return release

    def live_versions(self) -> set[int]:
        """Versions whose weights a request in flight or the next admission may still need."""
        return {r.policy_version for r in self.requests.values()} | {self.version}

    @property
    def plan(self):
        return self.versions[self.version].plan

    def groups_per_step(self) -> int:
        return self.b * self.plan.groups_per_prompt

    def admit(self, learner_busy: bool, queued: int = 0) -> list[RolloutRequest]:
        """Admit prompts while the staleness bound allows; their requests, one per slot. `queued`:
        steps taken but waiting behind the running one, not counted as begun by the bound."""
        requests = []
        while admission_open(mode=self.mode, admitted_prompts=self.admitted_prompts, learner_steps=self.step - queued,
                             learner_busy=learner_busy, prompts_per_step=self.b, max_offpolicy=self.max_offpolicy,
                             total_steps=self.total_steps):
            requests += self._admit_one()
        return requests

    def _admit_one(self) -> list[RolloutRequest]:
        index, only, rnd, scale, after_dead = self._next_admission()
        self.admitted_prompts += 1
        self.admission_no += 1
        item, info = self.stream[index], self.versions[self.version]
        plan = self.plan.scaled(scale) if scale != 1.0 else self.plan
        by_group: dict[int, list[RolloutRequest]] = {}
        for slot in plan.slots:
            g = plan.group_of(slot.index)
            if only is not None and g not in only:
                continue  # consumed before the checkpoint this run resumed from
            gid = f"p{index}/g{g}" + (f"/r{rnd}" if rnd else "")
            by_group.setdefault(g, []).append(RolloutRequest(
                request_id=f"{gid}/s{slot.index}", group_id=gid, item=item, policy_version=self.version,
                slot=slot.index, slot_seed=slot.seed, n=plan.rollouts_per_slot, slot_scale=slot.scale))
        out = []
        for g, reqs in by_group.items():
            self.groups[reqs[0].group_id] = OpenGroup(index, g, item, self.version, info.learner_step,
                                                   tuple(r.request_id for r in reqs), round=rnd, scale=scale,
                                                   order=self.admission_no, after_dead=after_dead)
            out += reqs
        self._rounds[(index, rnd)] = OpenRound([reqs[0].group_id for reqs in by_group.values()], len(by_group),
                                            after_dead, scale)
        for r in out:
            self.requests[r.request_id] = r
        self.counts.admitted_rollouts += sum(r.n for r in out)
        return out

    def _next_admission(self) -> tuple[int, set | None, int, float, bool]:
        """(prompt index, its group indices or None for all, round, σ multiplier, after a dead round) of
        the next admission: what a checkpoint left in flight, then a waiting re-admission while the
        step it joins has budget left, else the next fresh prompt."""
        if self.readmit:
            return self.readmit.popleft()
        step = self.admitted_prompts // self.b
        if self.explore and self._readmits[step] < self.readmit_cap:
            self._readmits[step] += 1
            self.counts.readmitted_prompts += 1
            index, rnd, scale, after_dead = self.explore.popleft()
            return index, None, rnd, scale, after_dead
        self.next_index += 1
        return self.next_index - 1, None, 0, 1.0, False

    # --- routing ------------------------------------------------------------------------------------
    def route(self, requests: Sequence[RolloutRequest], samplers: Sequence[Hashable]) -> list[tuple[Hashable, list]]:
        """(sampler, requests) calls: `ledger_parts.route_calls` over the current plan's slots."""
        return route_calls(requests, [self.groups[r.group_id].prompt_index for r in requests],
                           len(self.plan.slots), samplers, self.per_call)

    # --- results --------------------------------------------------------------------------------------
    def arrived(self, key: Hashable, report: GenerateReport, scores: ScoreBatch) -> list[RolloutRequest]:
        """A scored batch: its requests join their groups, or come back to be generated again."""
        self._record_seq(f"{report.engine_id}/{report.incarnation}", report.first_seq_no, report.rows)
        expected = self.versions.get(report.policy_version)
        checksum_ok = expected is not None and report.mean_checksum == expected.mean_checksum
        retry, first = [], 0
        for rid, verified, n in zip(report.request_ids, report.verified, report.request_rows):
            rows = slice(first, first + n)
            first += n
            group = self.groups.get(rid.rsplit("/", 1)[0])
            if group is None or rid in group.arrived:
                self.counts.duplicates += n  # the group was consumed, or this request arrived already
                continue
            if not (checksum_ok and verified):
                self.counts.rejected_weights += n
                retry.append(self.requests[rid])
            elif (scores.statuses[rows] == INFRA).any():
                self.counts.infra_errors += int((scores.statuses[rows] == INFRA).sum())
                retry.append(self.requests[rid])
            else:
                self._join(group, rid, key, rows, scores)
        return self._reissue(retry)

    def _join(self, group: OpenGroup, rid: str, key: Hashable, rows: slice, scores: ScoreBatch) -> None:
        group.arrived[rid] = (key, rows.start, rows.stop - rows.start)
        self._batch_refs[key] += 1
        self.requests.pop(rid)
        self.reissues.pop(rid, None)
        rnd, rewards = self._rounds[(group.prompt_index, group.round)], scores.rewards[rows]
        rnd.ok += int((scores.statuses[rows] == OK).sum())
        rnd.rows += len(rewards)
        rnd.lo, rnd.hi = min(rnd.lo, float(rewards.min())), max(rnd.hi, float(rewards.max()))
        if len(group.arrived) == len(group.expected):
            self._arrived_holds[group.version] += 1
            rnd.left -= 1
            if not rnd.left:
                self._close_round(group.prompt_index, group.round)

    def _close_round(self, index: int, number: int) -> None:
        """Every group of a round is complete: note its outcome, then drop it (dynamic filter, within
        budget: its admission goes to another prompt) or make its groups ready."""
        rnd = self._rounds.pop((index, number))
        groups = [self.groups[gid] for gid in rnd.groups]
        for g in groups:
            g.outcome = (rnd.ok == 0, rnd.ok == rnd.rows)
        if self.rule.dynamic_filter and rnd.lo == rnd.hi and self._dropped_this_step < self.filter_cap:
            self._dropped_this_step += 1
            self.admitted_prompts -= 1  # its place in the step goes to the next admission
            for gid, g in zip(rnd.groups, groups):
                self._consume(g)
                self._filtered.append(gid)
                self.counts.dropped_groups += 1
                self.counts.dropped_rollouts += sum(n for _, _, n in g.arrived.values())
            return
        for gid, g in zip(rnd.groups, groups):
            heapq.heappush(self._ready, (g.order, g.index, gid))

    def _round_consumed(self, group: OpenGroup) -> None:
        """The last group of a round was consumed (or dropped): count its outcome and queue the
        prompt's re-admission (dead-group-aware exploration). Done at consumption, not on arrival,
        so a checkpoint's counts and queue hold exactly the consumed rounds."""
        (dead, solved), c, rule = group.outcome, self.counts, self.rule
        c.dead_prompts += dead
        c.solved_prompts += solved
        if group.after_dead:
            c.retried_dead += 1
            c.rescued_dead += not dead
        scale = rule.dead_group_scale if dead else (rule.solved_group_scale if solved and rule.solved_group_scale != 1.0 else None)
        if scale is None or not self.readmit_cap or group.round >= rule.readmit_max:
            return
        if len(self.explore) < self.readmit_cap:
            self.explore.append((group.prompt_index, group.round + 1, scale, dead))
        else:
            c.readmit_dropped += 1

    def lost(self, requests: Sequence[RolloutRequest], *, sampler: bool) -> list[RolloutRequest]:
        """A call failed (its sampler or verifier died): generate its requests again."""
        if sampler:
            self.counts.sampler_failures += 1
        else:
            self.counts.verifier_failures += 1
        return self._reissue([r for r in requests if r.request_id in self.requests])

    def verifier_failed(self) -> None:
        """A verifier died on a batch the driver sends to another one (its requests stay in flight)."""
        self.counts.verifier_failures += 1

    def _reissue(self, requests: list[RolloutRequest]) -> list[RolloutRequest]:
        for r in requests:
            self.reissues[r.request_id] += 1
            if self.reissues[r.request_id] > self.max_reissues:
                raise PersistentFailure(
                    f"request {r.request_id} failed {self.reissues[r.request_id]} times (runtime.max_reissues="
                    f"{self.max_reissues}): sampler crashes, weight-check failures or infra_error scores")
        self.counts.reissued_requests += len(requests)
        return requests

    def _record_seq(self, engine: str, first: int, rows: int) -> None:
        """Sequence numbers seen per engine incarnation: rows missing inside the observed span are
        work an engine did that never arrived (a gap)."""
        if not rows:
            return
        lo, hi = self._seq.get(engine, [first, first + rows - 1])
        self._seq[engine] = [min(lo, first), max(hi, first + rows - 1)]
        self._seq_seen[engine] += rows
        self.counts.seq_gaps = sum(max(0, (hi - lo + 1) - self._seq_seen[e]) for e, (lo, hi) in self._seq.items())

    # --- consumption ----------------------------------------------------------------------------------
    def ready(self) -> int:
        return len(self._ready)

    def arrived_holds(self) -> Counter:
        """Groups whose rollouts have all arrived since the last call, per version: the posterior
        holds their admissions took, which the driver releases."""
        out, self._arrived_holds = self._arrived_holds, Counter()
        return out

    def take(self) -> tuple[list[GroupRows], list[Hashable], list[Hashable]]:
        """The next step's groups, oldest admitted first: (group rows, the batch keys they index,
        batch keys no open group needs any more). Groups the dynamic filter dropped since the last
        take are released here too (their batch keys)."""
        chosen = [heapq.heappop(self._ready)[2] for _ in range(self.groups_per_step())]
        keys: list = []
        rows = []
        for gid in chosen:
            group = self.groups.pop(gid)
            parts = []
            for rid in group.expected:
                key, first, n = group.arrived[rid]
                if key not in keys:
                    keys.append(key)
                parts.append((keys.index(key), first, n))
                self._batch_refs[key] -= 1
            rows.append(GroupRows(gid, group.item, group.version, group.published_step, tuple(parts)))
            self._consume(group)
            self.counts.consumed_rollouts += sum(n for _, _, n in parts)
        released = []
        for gid in self._filtered:  # consumed when dropped; their batches and versions go now
            group = self.groups.pop(gid)
            for key, _, _ in group.arrived.values():
                self._batch_refs[key] -= 1
                released.append(key)
        self._filtered, self._dropped_this_step = [], 0
        drop = [k for k in dict.fromkeys(keys + released) if self._batch_refs[k] <= 0]
        for k in drop:
            del self._batch_refs[k]
        self.step += 1
        self._readmits = Counter({s: n for s, n in self._readmits.items() if s >= self.step})
        return rows, keys, drop

    def _consume(self, group: OpenGroup) -> None:
        key = group.prompt_index if not group.round else (group.prompt_index, group.round)
        done = self._partial.setdefault(key, set())
        if group.index in done or (key in self.consumed_rounds if group.round else key in self.consumed):
            raise RuntimeError(f"group p{group.prompt_index}/g{group.index} (round {group.round}) consumed twice: "
                               "exactly-once violated")
        done.add(group.index)
        if len(done) == self.versions[group.version].plan.groups_per_prompt:
            del self._partial[key]
            (self.consumed_rounds.add if group.round else self.consumed.add)(key)
            self._round_consumed(group)

    def exploration_figures(self) -> dict:
        """Cumulative counts of dead-group-aware exploration and the dynamic filter, for the step log."""
        c = self.counts
        return {"dead_prompts": c.dead_prompts, "solved_prompts": c.solved_prompts,
                "readmitted_prompts": c.readmitted_prompts, "retried_dead": c.retried_dead,
                "rescued_dead": c.rescued_dead, "rescue_rate": c.rescued_dead / c.retried_dead if c.retried_dead else 0.0,
                "dropped_groups": c.dropped_groups}

    def drop_unused(self, key: Hashable) -> bool:
        """True when no open group points into batch `key` (its rows were all refused or duplicates)."""
        return self._batch_refs.get(key, 0) == 0

    # --- checkpoint ---------------------------------------------------------------------------------
    def state(self) -> dict:
        """Plain values to resume from: cursor, consumed prompts, what to admit again, counts (a
        snapshot: nothing in it changes when the ledger goes on)."""
        open_rounds: dict[tuple, list[int]] = {}
        dropped = set(self._filtered)
        for gid, g in self.groups.items():
            if gid not in dropped:  # a dropped group is consumed
                open_rounds.setdefault((g.prompt_index, g.round, g.scale, g.after_dead), []).append(g.index)
        readmit = sorted([i, sorted(gs), r, c, d] for (i, r, c, d), gs in open_rounds.items())
        readmit += [[i, sorted(gs), r, c, d] for i, gs, r, c, d in self.readmit]
        counts = dict(vars(self.counts))
        # admitted-but-unconsumed is regenerated
        counts["admitted_rollouts"] = self.counts.consumed_rollouts + self.counts.dropped_rollouts
        return {"step": self.step, "next_index": self.next_index, "readmit": readmit,
                "explore": [list(e) for e in self.explore], "consumed_rounds": sorted(map(list, self.consumed_rounds)),
                "consumed": [list(r) for r in self.consumed.ranges],
                "partial": {round_key(k): sorted(v) for k, v in self._partial.items()}, "counts": counts}

    def load(self, state: dict) -> None:
        """Resume from `state`; a state written before re-admissions existed (no rounds) loads too."""
        self.step, self.next_index = state["step"], state["next_index"]
        self.readmit = deque((e[0], set(e[1]), *(e[2:] or (0, 1.0, False))) for e in state["readmit"])
        self.explore = deque(tuple(e) for e in state.get("explore", []))
        self.consumed_rounds = {tuple(k) for k in state.get("consumed_rounds", [])}
        self.admitted_prompts = self.step * self.b
        self.consumed = RangeSet(state["consumed"])
        self._partial = {parse_round_key(k): set(v) for k, v in state["partial"].items()}
        self.counts = Counts(**state["counts"])

