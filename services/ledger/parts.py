"""The plain parts of the driver's ledger (services/ledger/ledger.py, whose docstring states the rules):
the admission rule under the staleness bound, the routing rule, the re-admission settings, the
ledger's records of its open groups and rounds, its delivery counts, and how a round's key is written
in a checkpoint."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from threepo.services.wire.messages import STATUSES, RolloutRequest, TaskItem, VerifyStatus


def admission_open(*, mode: str, admitted_prompts: int, learner_steps: int, learner_busy: bool,
                   prompts_per_step: int, max_offpolicy: int, total_steps: int) -> bool:
    """May one more prompt be admitted now? (services/ledger/ledger.py's docstring states the rule.)"""
    step_of_next = admitted_prompts // prompts_per_step  # the learner step that will consume it
    if step_of_next >= total_steps:
        return False  # never admit what the run will not consume
    if mode == "sync":
        return step_of_next == learner_steps and not learner_busy
    return step_of_next <= learner_steps + max_offpolicy


OK = STATUSES.index(VerifyStatus.OK)


@dataclass(frozen=True)
class Readmission:
    """What the ledger does with uninformative rounds (module docstring): the run's `[algo]` settings, by their names."""

    readmit_fraction: float = 0.0   # re-admissions among a step's B prompts, ⌈fraction·B⌉ (0 = off)
    readmit_max: int = 1            # re-admissions of one prompt
    dead_group_scale: float = 1.0   # σ multiplier of a re-admitted all-fail prompt
    solved_group_scale: float = 1.0  # of an all-pass one (1 = solved ones are not re-admitted)
    dynamic_filter: bool = False    # drop equal-reward rounds before the learner takes them
    filter_replacements: float = 0.0  # most dropped rounds per learner step, ⌈·B⌉

    @classmethod
    def of(cls, algo) -> Readmission:
        """The `[algo]` settings of the same names (filter_replacements only with dynamic_filter)."""
        return cls(readmit_fraction=algo.readmit_fraction, readmit_max=algo.readmit_max,
                   dead_group_scale=algo.dead_group_scale, solved_group_scale=algo.solved_group_scale,
                   dynamic_filter=algo.dynamic_filter,
                   filter_replacements=algo.filter_replacements if algo.dynamic_filter else 0.0)


@dataclass
class OpenGroup:
    """An admitted group that is not consumed yet."""

    prompt_index: int
    index: int                  # group index within the prompt (M3PO: one per slot group)
    item: TaskItem
    version: int
    published_step: int
    expected: tuple[str, ...]   # its requests, in slot order
    arrived: dict = field(default_factory=dict)  # request id -> (batch key, first row, rows)
    round: int = 0              # 0: fresh; r ≥ 1: the r-th re-admission of the prompt
    scale: float = 1.0          # σ multiplier of its slots
    order: int = 0              # admission sequence number (groups are consumed oldest first)
    after_dead: bool = False    # its round re-admits a prompt whose previous round was all-fail
    outcome: tuple = ()         # (dead, solved) of its round, once every group of the round is complete


@dataclass
class OpenRound:
    """One admission of a prompt (its groups) and what its rollouts scored so far."""

    groups: list[str]
    left: int                   # groups not complete yet
    after_dead: bool            # re-admitted because its previous round was all-fail
    scale: float
    ok: int = 0
    rows: int = 0
    lo: float = math.inf
    hi: float = -math.inf


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
    dead_prompts: int = 0         # rounds whose rollouts all failed (no `ok`)
    solved_prompts: int = 0       # rounds whose rollouts all passed
    readmitted_prompts: int = 0   # re-admissions (dead-group-aware exploration)
    readmit_dropped: int = 0      # dead/solved rounds not re-admitted: the queue was full
    retried_dead: int = 0         # completed re-admissions of a prompt whose previous round was dead
    rescued_dead: int = 0         # ... with at least one successful rollout
    dropped_groups: int = 0       # groups the dynamic filter dropped before the learner (replaced)
    dropped_rollouts: int = 0


class PersistentFailure(RuntimeError):
    """A request failed more often than `runtime.max_reissues` allows."""




def round_key(key: int | tuple[int, int]) -> str:
    """A prompt's (round 0) or a re-admission's key as JSON text: "12" or "12/r1"."""
    return str(key) if isinstance(key, int) else f"{key[0]}/r{key[1]}"


def parse_round_key(text: str) -> int | tuple[int, int]:
    index, _, rnd = text.partition("/r")
    return (int(index), int(rnd)) if rnd else int(index)


def route_calls(requests: Sequence[RolloutRequest], prompts: Sequence[int], n_slots: int,
                samplers: Sequence[Hashable], per_call: int) -> list[tuple[Hashable, list]]:
    """(sampler, requests) calls, one version per call and at most `per_call` each (`prompts`: each
    request's prompt index). Request (prompt p, slot s) goes to sampler (p·S + s) mod n of the live
    ones: with at least as many slots as engines each engine keeps its slots (no weight switching),
    otherwise prompts spread round-robin. A sampler's requests are cut into calls slot by slot, so a
    call serves as few slots as possible and each slot's prompts are decoded in one batch."""
    if not samplers:
        raise RuntimeError("no sampler is alive to route requests to")
    by_target: dict = {}
    for r, p in zip(requests, prompts):
        target = samplers[(p * n_slots + r.slot) % len(samplers)]
        by_target.setdefault((target, r.policy_version), []).append(r)
    calls = []
    for (target, _), reqs in by_target.items():
        reqs = sorted(reqs, key=lambda r: (r.slot, r.slot_scale))  # stable: admission order within a slot
        calls += [(target, reqs[k:k + per_call]) for k in range(0, len(reqs), per_call)]
    return calls
