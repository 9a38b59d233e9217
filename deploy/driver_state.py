"""What the driver loop (deploy/run.py) tracks between iterations, `Loop`, and the typed events it
waits on: every reference in `Loop.inflight` maps to the event its result is, and `run()` handles
each kind in one `match`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from threepo.deploy.metrics import RestartCounter
from threepo.deploy.outputs import Window

if TYPE_CHECKING:
    from threepo.deploy.actors import Roles
    from threepo.deploy.config import RunConfig
    from threepo.deploy.outputs import RunLog
    from threepo.services.ledger.ledger import Ledger


@dataclass
class Call:
    """One sampler call in flight: its requests and the references of what it returns."""

    sampler: int
    requests: list
    report: object                 # ref -> GenerateReport
    batch: object                  # ref -> CompletionBatch (never fetched by the driver)
    verifier_attempts: int = 1


@dataclass(frozen=True)
class Joined:
    """A started or restarting sampler's probe answered (or failed)."""

    sampler: int


@dataclass(frozen=True)
class Scored:
    """A sampler call's batch was scored by a verifier."""

    call: Call


@dataclass(frozen=True)
class Learned:
    """A learner step finished (`on_learned` takes the results in step order)."""


@dataclass(frozen=True)
class Published:
    """The posterior server stored a version; `weights`: the learner's published object."""

    weights: object


@dataclass(frozen=True)
class Evaluated:
    """A held-out evaluation after learner step `step` finished."""

    step: int


@dataclass(frozen=True)
class Saved:
    """A role finished writing its part of a checkpoint."""


Event = Joined | Scored | Learned | Published | Evaluated | Saved


@dataclass
class Loop:
    """What the driver tracks between iterations (its one owner)."""

    cfg: RunConfig
    roles: Roles
    ledger: Ledger
    log: RunLog
    inflight: dict[object, Event] = field(default_factory=dict)  # ref -> the event its result is
    batches: dict = field(default_factory=dict)    # batch key -> (batch ref, score ref), while a group needs it
    weights: dict = field(default_factory=dict)    # version -> ref of its PublishedVersion
    learning: list = field(default_factory=list)   # (step, result ref, version ref) in flight, oldest first
    next_key: int = 0
    verifier_turn: int = 0
    window: Window = field(default_factory=Window)
    idle_since: float | None = field(default_factory=time.monotonic)  # the learner waiting for groups
    pending: object = None                          # a checkpoint being written
    reported: dict = field(default_factory=dict)
    restarts: RestartCounter = field(default_factory=RestartCounter)
    joining: set = field(default_factory=set)       # samplers started or restarting, not answering yet
    restarting: dict = field(default_factory=dict)  # fixed pool: sampler -> when it was first seen restarting
    backlog: list = field(default_factory=list)     # requests waiting for a sampler to exist
    pool_checked: float = 0.0
