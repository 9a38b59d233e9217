"""The driver's bookkeeping, without Ray: the prompt stream, admission under the staleness bound,
routing to samplers, group assembly, re-issue and delivery accounting — `Ledger`, owned by the
driver and unit-tested directly (tests/services/test_ledger.py).

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
  came back `infra_error` is generated again, at most `max_reissues` times, then the run stops.

The ledger holds ids, counts and (batch key, row) positions only — never completions: batches stay
in the object store under keys the driver maps to references, and the ledger says when a batch is
no longer needed by any group (`take` returns the keys to drop).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from threepo.services.batching import INFRA
from threepo.services.messages import GenerateReport, GroupRows, RolloutRequest, ScoreBatch, TaskItem
from threepo.services.posterior import VersionPlan


def admission_open(*, mode: str, admitted_prompts: int, learner_steps: int, learner_busy: bool,
                   prompts_per_step: int, max_offpolicy: int, total_steps: int) -> bool:
    """May one more prompt be admitted now? (See the module docstring for the rule.)"""
    step_of_next = admitted_prompts // prompts_per_step  # the learner step that will consume it
    if step_of_next >= total_steps:
        return False  # never admit what the run will not consume
    if mode == "sync":
        return step_of_next == learner_steps and not learner_busy
    return step_of_next <= learner_steps + max_offpolicy


class PromptStream:
    """Item `i` of an endless, reproducible stream: epochs of `items` in a seeded shuffled order."""

    def __init__(self, items: list[TaskItem], seed: int) -> None:
        if not items:
            raise ValueError("the prompt stream is empty: check data.path or the task settings")
        self.items, self.seed, self._orders = items, seed, {}

    def __getitem__(self, i: int) -> TaskItem:
        epoch, pos = divmod(i, len(self.items))
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: the stream only moves forward
        return self.items[self._orders[epoch][pos]]


class RangeSet:
    """A set of non-negative integers kept as sorted, disjoint [start, end) ranges."""

    def __init__(self, ranges: Sequence[Sequence[int]] = ()) -> None:
        self.ranges: list[list[int]] = []
        for start, end in ranges:
            for i in range(start, end):
                self.add(i)

    def add(self, i: int) -> None:
        if i in self:
            raise ValueError(f"{i} is already in the set")
        at = next((k for k, (a, _) in enumerate(self.ranges) if a > i), len(self.ranges))
        self.ranges.insert(at, [i, i + 1])
        for k in (at, at - 1):  # merge with the right neighbour, then the left one
            if 0 <= k < len(self.ranges) - 1 and self.ranges[k][1] == self.ranges[k + 1][0]:
                self.ranges[k][1] = self.ranges.pop(k + 1)[1]

    def __contains__(self, i: int) -> bool:
        return any(a <= i < b for a, b in self.ranges)

    def __len__(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass
class _Group:
    """An admitted group that is not consumed yet."""

    prompt_index: int
    index: int                  # group index within the prompt (M3PO: one per slot group)
    item: TaskItem
    version: int
    published_step: int
    expected: tuple[str, ...]   # its requests, in slot order
    arrived: dict = field(default_factory=dict)  # request id -> (batch key, first row, rows)


@dataclass
class Counts:
    """Delivery counts, asserted by the integration tests and written to summary.json."""

    admitted_rollouts: int = 0
    consumed_rollouts: int = 0
    reissued_requests: int = 0
    rejected_weights: int = 0     # rows of requests whose engine failed a weight check
    infra_errors: int = 0         # rows scored infra_error (their requests re-issued)
    duplicates: int = 0           # rows of a request that had already arrived
    sampler_failures: int = 0
    verifier_failures: int = 0
    seq_gaps: int = 0


class PersistentFailure(RuntimeError):
    """A request failed more often than `runtime.max_reissues` allows."""


class Ledger:
    """Admission, routing, assembly and delivery accounting of one run; see the module docstring."""

    def __init__(self, stream: PromptStream, *, prompts_per_step: int, max_offpolicy: int, total_steps: int,
                 mode: str, max_reissues: int, requests_per_call: int) -> None:
        self.stream, self.b, self.max_offpolicy = stream, prompts_per_step, max_offpolicy
        self.total_steps, self.mode, self.max_reissues, self.per_call = total_steps, mode, max_reissues, requests_per_call
        self.step = 0                 # learner steps consumed
        self.next_index = 0           # next fresh prompt of the stream
        self.admitted_prompts = 0     # admission counter of the staleness rule
        self.readmit: deque = deque()  # (prompt index, group indices) to admit again (resume)
        self.version: int | None = None
        self.versions: dict[int, VersionPlan] = {}
        self.groups: dict[str, _Group] = {}
        self.requests: dict[str, RolloutRequest] = {}  # in flight
        self.reissues: Counter = Counter()
        self._ready: list = []        # heap of (prompt index, group id): complete groups, oldest first
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

    @property
    def plan(self):
        return self.versions[self.version].plan

    def groups_per_step(self) -> int:
        return self.b * self.plan.groups_per_prompt

    def admit(self, learner_busy: bool) -> list[RolloutRequest]:
        """Admit prompts while the staleness bound allows; their requests, one per slot."""
        requests = []
        while admission_open(mode=self.mode, admitted_prompts=self.admitted_prompts, learner_steps=self.step,
                             learner_busy=learner_busy, prompts_per_step=self.b, max_offpolicy=self.max_offpolicy,
                             total_steps=self.total_steps):
            requests += self._admit_one()
        return requests

    def _admit_one(self) -> list[RolloutRequest]:
        if self.readmit:
            index, only = self.readmit.popleft()
        else:
            index, only = self.next_index, None
            self.next_index += 1
        self.admitted_prompts += 1
        item, plan, info = self.stream[index], self.plan, self.versions[self.version]
        by_group: dict[int, list[RolloutRequest]] = {}
        for slot in plan.slots:
            g = plan.group_of(slot.index)
            if only is not None and g not in only:
                continue  # consumed before the checkpoint this run resumed from
            rid = f"p{index}/g{g}/s{slot.index}"
            by_group.setdefault(g, []).append(RolloutRequest(request_id=rid, group_id=f"p{index}/g{g}", item=item,
                                                             policy_version=self.version, slot=slot.index,
                                                             slot_seed=slot.seed, n=plan.rollouts_per_slot))
        out = []
        for g, reqs in by_group.items():
            self.groups[f"p{index}/g{g}"] = _Group(index, g, item, self.version, info.learner_step,
                                                   tuple(r.request_id for r in reqs))
            out += reqs
        for r in out:
            self.requests[r.request_id] = r
        self.counts.admitted_rollouts += sum(r.n for r in out)
        return out

    # --- routing ------------------------------------------------------------------------------------
    def route(self, requests: Sequence[RolloutRequest], samplers: Sequence[Hashable]) -> list[tuple[Hashable, list]]:
        """(sampler, requests) calls, one version per call and at most `requests_per_call` each.
        Request (prompt p, slot s) goes to sampler (p·S + s) mod n of the live ones: with at least as
        many slots as engines each engine keeps its slots (no weight switching), otherwise prompts
        spread round-robin."""
        if not samplers:
            raise RuntimeError("no sampler is alive to route requests to")
        by_target: dict = {}
        for r in requests:
            p = self.groups[r.group_id].prompt_index
            target = samplers[(p * len(self.plan.slots) + r.slot) % len(samplers)]
            by_target.setdefault((target, r.policy_version), []).append(r)
        return [(target, reqs[k:k + self.per_call]) for (target, _), reqs in by_target.items()
                for k in range(0, len(reqs), self.per_call)]

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
                self._join(group, rid, key, rows.start, n)
        return self._reissue(retry)

    def _join(self, group: _Group, rid: str, key: Hashable, first: int, n: int) -> None:
        group.arrived[rid] = (key, first, n)
        self._batch_refs[key] += 1
        self.requests.pop(rid)
        self.reissues.pop(rid, None)
        if len(group.arrived) == len(group.expected):
            heapq.heappush(self._ready, (group.prompt_index, group.index, rid.rsplit("/", 1)[0]))

    def lost(self, requests: Sequence[RolloutRequest], *, sampler: bool) -> list[RolloutRequest]:
        """A call failed (its sampler or verifier died): generate its requests again."""
        if sampler:
            self.counts.sampler_failures += 1
        else:
            self.counts.verifier_failures += 1
        return self._reissue([r for r in requests if r.request_id in self.requests])

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

    def take(self) -> tuple[list[GroupRows], list[Hashable], list[Hashable], Counter]:
        """The next step's groups, oldest admitted first: (group rows, the batch keys they index,
        batch keys no open group needs any more, groups consumed per version)."""
        chosen = [heapq.heappop(self._ready)[2] for _ in range(self.groups_per_step())]
        keys: list = []
        rows, versions = [], Counter()
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
            versions[group.version] += 1
            self._consume(group)
            self.counts.consumed_rollouts += sum(n for _, _, n in parts)
        drop = [k for k in keys if self._batch_refs[k] <= 0]
        for k in drop:
            del self._batch_refs[k]
        self.step += 1
        return rows, keys, drop, versions

    def _consume(self, group: _Group) -> None:
        done = self._partial.setdefault(group.prompt_index, set())
        if group.index in done or group.prompt_index in self.consumed:
            raise RuntimeError(f"group p{group.prompt_index}/g{group.index} consumed twice: exactly-once violated")
        done.add(group.index)
        if len(done) == self.versions[group.version].plan.groups_per_prompt:
            del self._partial[group.prompt_index]
            self.consumed.add(group.prompt_index)

    def drop_unused(self, key: Hashable) -> bool:
        """True when no open group points into batch `key` (its rows were all refused or duplicates)."""
        return self._batch_refs.get(key, 0) == 0

    # --- checkpoint ---------------------------------------------------------------------------------
    def state(self) -> dict:
        """Plain values to resume from: cursor, consumed prompts, what to admit again, counts (a
        snapshot: nothing in it changes when the ledger goes on)."""
        open_prompts: dict[int, list[int]] = {}
        for g in self.groups.values():
            open_prompts.setdefault(g.prompt_index, []).append(g.index)
        readmit = sorted([i, sorted(gs)] for i, gs in open_prompts.items()) + [[i, sorted(gs)] for i, gs in self.readmit]
        counts = dict(vars(self.counts))
        counts["admitted_rollouts"] = self.counts.consumed_rollouts  # admitted-but-unconsumed is regenerated
        return {"step": self.step, "next_index": self.next_index, "readmit": readmit,
                "consumed": [list(r) for r in self.consumed.ranges], "partial": {str(k): sorted(v) for k, v in self._partial.items()},
                "counts": counts}

    def load(self, state: dict) -> None:
        self.step, self.next_index = state["step"], state["next_index"]
        self.readmit = deque((i, set(gs)) for i, gs in state["readmit"])
        self.admitted_prompts = self.step * self.b
        self.consumed = RangeSet(state["consumed"])
        self._partial = {int(k): set(v) for k, v in state["partial"].items()}
        self.counts = Counts(**state["counts"])
