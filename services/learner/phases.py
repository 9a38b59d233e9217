"""Where a learner step's time goes: wall and CPU seconds by phase, reported with every step's metrics
(`time/<phase>_s`, `cpu/<phase>_s`).

Phases nest: time inside an inner phase counts to the inner one alone, so the phases of a step add up
to the time measured inside any of them. CPU seconds are the calling thread's (`time.thread_time`):
the learner computes on one thread on the CPU (`learner.threads` 1); with more torch threads, or on a
GPU, the wall seconds are the ones to read. The phases the learner names (services/learner/core.py):

- forward: the update's forwards with their losses, and the no-grad forwards of π_prox at later
  updates' gradient points;
- backward: the loss's backward;
- sample: writing a gradient point θ̂′ = m + σ ⊙ z′ into the weights and, after its backward, folding
  the gradients into the optimizer's accumulators and restoring m (AdamW: nothing);
- step: the optimizer's update (VP2O's transport included);
- drift: the sync budget's diagnostic where it needs a forward of its own (each measured rollout's
  slot rebuilt from the start-of-step posterior), building those slots included;
- noise: the noise control's work in the learner (measurements from the batches, the calibration
  before the first version, a probe where the engines do not measure);
- publish: `published()`, the version's (m, σ) as arrays;
- other: everything else of the step (collating, advantages, metrics).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PHASES = ("forward", "backward", "sample", "step", "drift", "noise", "publish", "other")


class PhaseClock:
    """Wall and thread-CPU seconds by phase since the last `take`; `phase(name)` counts a block."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._stack: list[list] = []  # [name, wall at (re)start, cpu at (re)start] of the open phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown learner phase {name!r}, expected one of {PHASES}")
        now = (time.perf_counter(), time.thread_time())
        if self._stack:  # the enclosing phase stops counting while this one runs
            self._add(self._stack[-1], now)
        self._stack.append([name, *now])
        try:
            yield
        finally:
            now = (time.perf_counter(), time.thread_time())
            self._add(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1:] = now

    @contextlib.contextmanager
    def around(self, name: str, context) -> Iterator[None]:
        """Enter and leave `context` (a context manager) inside phase `name`, its body outside it."""
        with self.phase(name):
            context.__enter__()
        try:
            yield
        except BaseException as error:
            with self.phase(name):
                if not context.__exit__(type(error), error, error.__traceback__):
                    raise
        else:
            with self.phase(name):
                context.__exit__(None, None, None)

    def _add(self, entry: list, now: tuple[float, float]) -> None:
        name, wall, cpu = entry
        self.wall[name] = self.wall.get(name, 0.0) + now[0] - wall
        self.cpu[name] = self.cpu.get(name, 0.0) + now[1] - cpu

    def take(self) -> dict[str, float]:
        """`time/<phase>_s` and `cpu/<phase>_s` of every phase counted since the last `take`, then zero."""
        out = {**{f"time/{k}_s": v for k, v in self.wall.items()}, **{f"cpu/{k}_s": v for k, v in self.cpu.items()}}
        self.wall, self.cpu = {}, {}
        return out
