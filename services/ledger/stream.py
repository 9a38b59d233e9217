"""The driver's prompt stream and the compact index sets its ledger keeps (services/ledger/ledger.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from threepo.services.wire.messages import TaskItem


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
