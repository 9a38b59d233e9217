"""A concurrency limiter shared by the whole Ray cluster: a named, detached actor semaphore.

The pattern verl uses for its sandbox tools (operations.md §3.4): every process that calls the
remote sandbox builds `ClusterLimiter(name=...)`, gets the one actor of that name
(`get_if_exists=True`) and wraps each request in `async with limiter:`. The capacity is fixed by
whoever creates the actor first.

Permits are leases: a holder that dies without releasing (a killed verifier actor) loses its
permit after `lease_s`, so a crash cannot shrink the cluster's capacity for good.

    limiter = ClusterLimiter("threepo-sandbox", capacity=64)
    verifier = load_verifier("remote_sandbox", endpoints=[...], limiter=limiter)
"""

from __future__ import annotations

import asyncio
import time
import uuid

import ray


class SemaphoreActor:
    """Counting semaphore with leased permits (runs as an async Ray actor)."""

    def __init__(self, capacity: int, lease_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"ClusterLimiter.capacity: expected >= 1, got {capacity}")
        self.capacity, self.lease_s = capacity, lease_s
        self.holders: dict[str, float] = {}  # token -> lease expiry (monotonic)
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the actor's event loop, at first use
            self._changed = asyncio.Condition()
        return self._changed

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, expiry in self.holders.items() if expiry <= now]:
            del self.holders[token]

    async def acquire(self, token: str) -> None:
        changed = self._condition()
        async with changed:
            while True:
                self._expire()
                if len(self.holders) < self.capacity:
                    self.holders[token] = time.monotonic() + self.lease_s
                    return
                soonest = min(self.holders.values()) - time.monotonic()
                try:  # wake on a release, or when the oldest lease runs out
                    await asyncio.wait_for(changed.wait(), timeout=max(soonest, 0.01))
                except asyncio.TimeoutError:
                    pass

    async def release(self, token: str) -> None:
        changed = self._condition()
        async with changed:
            self.holders.pop(token, None)
            changed.notify()

    def in_use(self) -> int:
        self._expire()
        return len(self.holders)


class ClusterLimiter:
    """`async with limiter:` holds one of `capacity` permits shared across the cluster."""

    def __init__(self, name: str = "threepo-sandbox-limiter", capacity: int = 64,
                 lease_s: float = 300.0, namespace: str = "threepo") -> None:
        self.name = name
        self._actor = ray.remote(SemaphoreActor).options(
            name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
            max_concurrency=10_000, num_cpus=0).remote(capacity, lease_s)
        self._tokens: dict[asyncio.Task, list[str]] = {}

    async def __aenter__(self) -> None:
        token = uuid.uuid4().hex
        await self._actor.acquire.remote(token)
        self._tokens.setdefault(asyncio.current_task(), []).append(token)

    async def __aexit__(self, *exc_info) -> None:
        task = asyncio.current_task()
        token = self._tokens[task].pop()
        if not self._tokens[task]:
            del self._tokens[task]
        await self._actor.release.remote(token)

    def in_use(self) -> int:
        """Permits held right now, cluster-wide."""
        return ray.get(self._actor.in_use.remote())
