"""The verifier pool: scores completions with the verifier each task names, concurrency-limited, and
retries infrastructure failures (architecture.md §2.3).

Verifiers are built lazily, one per name, by `load_verifier(name, **options)` (or a factory injected
for tests). `verify_batch` is synchronous so that a synchronous Ray actor can call it on its main
thread, where math-verify's SIGALRM timeouts work: it runs the async verifiers under a semaphore on an
event loop driven from the calling thread. A result with status `infra_error` says nothing about the
completion, so it is retried with exponential backoff and jitter; if it persists, the `infra_error`
(reward NaN) is returned — never a zero reward — and the driver keeps it out of the gradient. A
request repeated within one batch (the same completion text of the same item and finish reason:
most of a group's rollouts, on the embedded default) is verified once and answers every copy.
Retries happen at two levels that do not overlap: the remote sandbox client waits out a flaky or
briefly down service itself (services/verifiers/remote.py); the pool retries what a verifier still
returns as `infra_error`. A `VerifierOutage` (every endpoint down for longer than its bound) is not a
result: `verify_batch` cancels the rest of the batch and raises it to the caller.

`VerifierConfig` is the run's `[verifier]` section: which verifier serves which rows (`route`), the
verifiers' options, the pool's retries and concurrency, and the cluster-wide cap on remote requests
(deploy/limiter.py); the remote sandbox's own settings are `[sandbox]`
(services/verifiers/sandbox_config.py).

Not here: the checks themselves (services/verifiers/), what to do with an unscorable group (driver).
Departure: one event loop lives as long as the pool instead of one `asyncio.run` per batch, because
the remote sandbox client binds its HTTP session to a loop; a new loop per batch would open a new
session each time and could never close the old one.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from threepo.services.metrics import CATALOGUE, Metrics, register_catalogue
from threepo.services.verifiers.base import (BACKOFF_BASE_S, BACKOFF_MAX_S, INFRA_RETRIES, JITTER, MAX_CONCURRENCY,
                                             Verifier, VerifierOutage, load_verifier)
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.wire.messages import VerifyRequest, VerifyResult, VerifyStatus

_METRICS = ("threepo_verifier_results_total", "threepo_verifier_latency_seconds")


@dataclass(frozen=True)
class VerifierConfig:
    """The run's `[verifier]` section: who scores which rows, verifiers' own options, how the pool
    retries what a verifier returns as infra_error, and the cluster-wide cap on remote requests.
    Where the remote sandbox is and how it is called is `[sandbox]` (services/verifiers/sandbox_config.py)."""

    route: tuple[tuple[str, str], ...] = ()
    """(verifier a row names, verifier that scores it instead): a run-level override of
    `TaskItem.verifier`, e.g. [["code_output", "remote_sandbox"]]."""
    options: tuple[tuple[str, str, str], ...] = ()
    """Options of built-in or plug-in verifiers as (verifier, option, value), e.g. [["math", "answer",
    "last_number"]] (GSM8K's flexible extraction for models that do not box answers: the default with
    `data.format=gsm8k`; [["math", "answer", "boxed"]] there keeps the boxed rule) or [["math", "mode",
    "process"]]: string-valued options only (services/verifiers/*.py say which a verifier takes; the
    remote sandbox's are `[sandbox]`)."""
    max_concurrency: int = MAX_CONCURRENCY
    """Verifications in flight in one verifier actor (over all verifier names)."""
    infra_retries: int = INFRA_RETRIES
    """The pool's retries of a verification a verifier still returns as infra_error (attempts = 1 +
    this), after the remote sandbox client's own retries (`sandbox.max_attempts`)."""
    backoff_base_s: float = BACKOFF_BASE_S
    """The pool's delay before retry k (k = 0, 1, ...): min(backoff_max_s, base · 2^k) · U(1 − jitter, 1)."""
    backoff_max_s: float = BACKOFF_MAX_S
    """Cap on one of the pool's retry delays."""
    jitter: float = JITTER
    """Fraction of each of the pool's retry delays drawn at random, in [0, 1] (spreads a burst's retries)."""
    cluster_concurrency: int | Literal["off"] = 64
    """Remote sandbox requests in flight over the whole Ray cluster (deploy/limiter.py); `off`: no
    cluster-wide cap, only the per-actor `max_concurrency`."""
    limiter_name: str = "threepo-sandbox-limiter"
    """Name of the cluster-wide limiter; runs sharing a name share its permits (the first run to
    create it fixes the capacity)."""
    seed: int = 0
    """Seed of the pool's retry jitter; in a run, the run's `seed` unless set."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(tuple(o) for o in self.options))
        object.__setattr__(self, "route", tuple(tuple(r) for r in self.route))
        if not all(len(r) == 2 and all(isinstance(x, str) and x for x in r) for r in self.route):
            raise ValueError(f"verifier.route: expected [row verifier, verifier] pairs, got {self.route!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"verifier.max_concurrency: expected >= 1, got {self.max_concurrency}")
        if self.infra_retries < 0:
            raise ValueError(f"verifier.infra_retries: expected >= 0, got {self.infra_retries}")
        if self.cluster_concurrency != "off" and self.cluster_concurrency < 1:
            raise ValueError(f"verifier.cluster_concurrency: expected >= 1, or \"off\" (no cluster-wide cap), "
                             f"got {self.cluster_concurrency}")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("verifier.backoff_base_s/backoff_max_s: expected 0 <= base <= max, got "
                             f"{self.backoff_base_s}, {self.backoff_max_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"verifier.jitter: expected in [0, 1], got {self.jitter}")
        for option in self.options:
            if len(option) != 3 or not all(isinstance(x, str) for x in option[:2]):
                raise ValueError(f"verifier.options: expected (verifier name, option, value), got {option!r}")
            if option[0] == "remote_sandbox":
                raise ValueError(f"verifier.options: {option!r}: the remote sandbox is configured in [sandbox] "
                                 f"(sandbox.{option[1]}=...)")

    def options_of(self, name: str) -> dict[str, Any]:
        """Keyword options for verifier `name`."""
        return {key: value for verifier, key, value in self.options if verifier == name}

    def routed(self, name: str) -> str:
        """The verifier that scores rows naming `name`."""
        return dict(self.route).get(name, name)


class VerifierPool:
    """Scores `VerifyRequest`s in order; see the module docstring.

    `sandbox` and `token` are what the `remote_sandbox` verifier is built with (the run's `[sandbox]`
    and the token its `auth_env` names, read by the caller); `factories` maps verifier names to
    factories used instead of `load_verifier` (tests, embedding; `remote_sandbox`'s receives `config`
    and `token`); `sleep` is the async backoff sleep (tests pass a recorder, so nothing waits).
    `metrics` (services/metrics.py) receives result counts and latency (retries included) by verifier
    and status.
    """

    def __init__(self, cfg: VerifierConfig, *, sandbox: RemoteSandboxConfig | None = None, token: str = "",
                 factories: Mapping[str, Callable[..., Verifier]] | None = None,
                 sleep: Callable[[float], Awaitable[Any]] | None = None, metrics: Metrics | None = None):
        self.cfg, self._sandbox, self._token = cfg, sandbox or RemoteSandboxConfig(), token
        self._factories = dict(factories or {})
        self._sleep = sleep or asyncio.sleep
        self._rng = random.Random(cfg.seed)
        self._verifiers: dict[str, Verifier] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._status: Counter[str] = Counter()
        self._stats = {"requests": 0, "deduplicated": 0, "attempts": 0, "retries": 0, "latency_s_sum": 0.0,
                       "latency_s_max": 0.0}
        self._metrics = None if metrics is None else register_catalogue(
            metrics, [m for m in CATALOGUE if m.name in _METRICS])

    def verify_batch(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        """Results of `requests`, in order. Call from synchronous code (not inside a running loop)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.averify_batch(requests))

    async def averify_batch(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        """`verify_batch` for callers that already run an event loop."""
        loop = asyncio.get_running_loop()
        if self._limit is None or self._limit[0] is not loop:  # a semaphore belongs to one loop
            self._limit = (loop, asyncio.Semaphore(self.cfg.max_concurrency))
        # a request repeated in the batch (the same completion of the same item: common among a group's
        # rollouts) is verified once and its result given to each copy
        index: dict[tuple, int] = {}
        distinct, slot = [], []
        for r in requests:
            key = (r.item.uid, r.item.verifier, r.completion, r.finish_reason)
            if key not in index:
                index[key] = len(distinct)
                distinct.append(r)
            slot.append(index[key])
        self._stats["deduplicated"] += len(requests) - len(distinct)
        verifiers = [self._verifier(self.cfg.routed(r.item.verifier)) for r in distinct]  # unknown: fail now
        tasks = [asyncio.ensure_future(self._verify(v, r, self._limit[1])) for v, r in zip(verifiers, distinct)]
        try:
            results = await asyncio.gather(*tasks)
            return [results[s] for s in slot]
        except VerifierOutage:  # no verification can finish now: stop the others, tell the caller
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def stats(self) -> dict:
        """Counts of final statuses, attempts, retries and latency (seconds, retries included) of the
        verifications run, and of the requests answered by another's (`deduplicated`)."""
        return dict(self._stats, status=dict(self._status))

    def close(self) -> None:
        """Close every verifier built so far, then the event loop."""
        verifiers, self._verifiers = list(self._verifiers.values()), {}
        for verifier in verifiers:
            verifier.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    def backoff_s(self, retry: int) -> float:
        """Delay before retry `retry` (0-based): capped exponential, shortened by up to `jitter`."""
        cfg = self.cfg
        return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** retry) * (1 - cfg.jitter * self._rng.random())

    def _verifier(self, name: str) -> Verifier:
        if name not in self._verifiers:
            options = self.cfg.options_of(name)
            if name == "remote_sandbox":
                options = {"config": self._sandbox, "token": self._token}
            self._verifiers[name] = (self._factories[name](**options) if name in self._factories
                                     else load_verifier(name, **options))
        return self._verifiers[name]

    async def _verify(self, verifier: Verifier, request: VerifyRequest, limit: asyncio.Semaphore) -> VerifyResult:
        started = time.perf_counter()
        for attempt in range(1 + self.cfg.infra_retries):
            if attempt:
                await self._sleep(self.backoff_s(attempt - 1))  # outside the semaphore: others proceed
                self._stats["retries"] += 1
            async with limit:
                self._stats["attempts"] += 1
                result = await verifier.verify(request)
            if result.status is not VerifyStatus.INFRA_ERROR:
                break
        if result.status is VerifyStatus.INFRA_ERROR and not math.isnan(result.reward):
            # a plug-in that breaks the NaN contract must still not put a number into the gradient
            result = replace(result, reward=math.nan,
                             details=f"{result.details} (reward {result.reward} replaced by NaN)")
        self._record(verifier.name, result.status, time.perf_counter() - started)
        return result

    def _record(self, verifier: str, status: VerifyStatus, latency_s: float) -> None:
        self._status[status.value] += 1
        self._stats["requests"] += 1
        self._stats["latency_s_sum"] += latency_s
        self._stats["latency_s_max"] = max(self._stats["latency_s_max"], latency_s)
        if self._metrics is not None:
            self._metrics["threepo_verifier_results_total"].inc(1, verifier=verifier, status=status.value)
            self._metrics["threepo_verifier_latency_seconds"].observe(latency_s, verifier=verifier,
                                                                      status=status.value)
