"""The driver's own state: the prompt stream, the admission rule, group assembly and delivery counts.

Everything here is plain Python (no Ray), so the rules the driver enforces are unit-tested directly:
- admission (staleness bound): prompt number `i` (0-based, admission order) will be consumed by
  learner step ⌊i / B⌋; it may be admitted only while that step is at most `max_offpolicy` steps
  after the step the learner is working towards, so no admitted group waits longer than that —
  admission control, nothing is ever discarded. The synchronous mode admits a step's prompts only
  when the previous step is complete;
- exactly-once: every completion id enters a group at most once and is consumed at most once;
  re-issued requests produce the same ids, which are dropped as duplicates.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from threepo.services.messages import Group, ScoredCompletion, TaskItem


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


@dataclass
class _Pending:
    item: TaskItem
    prompt_index: int
    policy_version: int
    published_step: int
    size: int
    completions: dict[str, ScoredCompletion] = field(default_factory=dict)


class GroupAssembler:
    """Collects scored completions into groups; hands out complete groups FIFO. A group's size is
    fixed when it is admitted (the plan's advantage-group size: G, or G/M for equal-compute M3PO)."""

    def __init__(self) -> None:
        self.pending: dict[str, _Pending] = {}
        self.ready: deque[tuple[Group, int]] = deque()  # (group, prompt index)
        self.duplicates = 0

    def expect(self, group_id: str, item: TaskItem, prompt_index: int, version: int, published_step: int,
               size: int) -> None:
        if group_id in self.pending:
            raise ValueError(f"group {group_id!r} admitted twice")
        self.pending[group_id] = _Pending(item, prompt_index, version, published_step, size)

    def add(self, scored: ScoredCompletion) -> None:
        c = scored.completion
        pending = self.pending.get(c.group_id)
        if pending is None or c.completion_id in pending.completions:
            self.duplicates += 1  # a re-issued request's copy, or a group already complete
            return
        pending.completions[c.completion_id] = scored
        if len(pending.completions) == pending.size:
            del self.pending[c.group_id]
            ordered = tuple(pending.completions[k] for k in sorted(pending.completions))
            group = Group(group_id=c.group_id, item=pending.item, policy_version=pending.policy_version,
                          published_step=pending.published_step, completions=ordered)
            self.ready.append((group, pending.prompt_index))

    def take(self, n: int) -> list[tuple[Group, int]]:
        """The `n` ready groups admitted earliest (oldest first keeps staleness low)."""
        ordered = sorted(self.ready, key=lambda t: (t[1], t[0].group_id))
        taken, self.ready = ordered[:n], deque(ordered[n:])
        return taken


@dataclass
class Delivery:
    """Counts that prove the delivery guarantees (asserted by the integration tests)."""

    admitted_rollouts: int = 0
    consumed_rollouts: int = 0
    reissued_requests: int = 0
    rejected_checksum: int = 0
    infra_errors: int = 0
    sampler_failures: int = 0
    consumed_ids: set[str] = field(default_factory=set)
    seq_ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def consume(self, groups: list[Group]) -> None:
        for g in groups:
            for s in g.completions:
                cid = s.completion.completion_id
                if cid in self.consumed_ids:
                    raise RuntimeError(f"completion {cid!r} consumed twice: exactly-once violated")
                self.consumed_ids.add(cid)
        self.consumed_rollouts += sum(len(g.completions) for g in groups)

    def record_seq(self, engine_key: str, first: int, last: int) -> None:
        self.seq_ranges.setdefault(engine_key, []).append((first, last))

    def seq_gaps(self) -> int:
        """Sequence numbers missing inside each engine incarnation's observed span."""
        gaps = 0
        for ranges in self.seq_ranges.values():
            covered = sum(b - a + 1 for a, b in ranges)
            gaps += (max(b for _, b in ranges) - min(a for a, _ in ranges) + 1) - covered
        return gaps
