"""`RayMetrics`: the metrics facade of services/metrics.py on `ray.util.metrics`.

Inside Ray each actor records through Ray's per-node metrics agent (one scrape target per node,
operations.md §2.2) instead of opening its own port. Metrics are made lazily, on the first
`counter`/`gauge`/`histogram` call, which happens inside the actor, so constructing a `RayMetrics`
(and pickling it into an actor) does no Ray work.

Ray's own conventions differ in two places, handled here so services keep one naming rule:
- Ray appends `_total` to counters itself, so the facade's `threepo_x_total` is registered as
  `threepo_x` (exported as `ray_threepo_x_total`).
- Ray refuses an `inc` of 0; a zero increment is a no-op here, as it is in Prometheus.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from threepo.services.metrics import (
    SECONDS_BUCKETS, Counter, Gauge, HandleCache, Histogram, MetricSpec, check_value, label_values,
)


class _RayHandle:
    def __init__(self, spec: MetricSpec, metric: Any) -> None:
        self.spec, self._metric = spec, metric

    def inc(self, value: float = 1.0, **labels: str | int) -> None:
        tags, value = label_values(self.spec, labels), check_value(self.spec, value)
        if value > 0:
            self._metric.inc(value, tags=tags)

    def set(self, value: float, **labels: str | int) -> None:
        tags, value = label_values(self.spec, labels), check_value(self.spec, value)
        self._metric.set(value, tags=tags)

    def observe(self, value: float, **labels: str | int) -> None:
        tags, value = label_values(self.spec, labels), check_value(self.spec, value)
        self._metric.observe(value, tags=tags)


def _make(spec: MetricSpec) -> _RayHandle:
    from ray.util import metrics as ray_metrics

    if spec.kind == "counter":
        metric = ray_metrics.Counter(spec.name.removesuffix("_total"), spec.doc, tag_keys=spec.labels)
    elif spec.kind == "gauge":
        metric = ray_metrics.Gauge(spec.name, spec.doc, tag_keys=spec.labels)
    else:
        metric = ray_metrics.Histogram(spec.name, spec.doc, boundaries=list(spec.buckets), tag_keys=spec.labels)
    return _RayHandle(spec, metric)


class RayMetrics:
    """The `Metrics` protocol on ray.util.metrics; use it inside Ray actors."""

    def __init__(self) -> None:
        self._cache = HandleCache()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._cache.get(MetricSpec("counter", name, doc, tuple(labels)), _make)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._cache.get(MetricSpec("gauge", name, doc, tuple(labels)), _make)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = SECONDS_BUCKETS) -> Histogram:
        spec = MetricSpec("histogram", name, doc, tuple(labels), tuple(float(b) for b in buckets))
        return self._cache.get(spec, _make)


class RestartCounter:
    """Restarts of restartable actors as the driver sees them: a new incarnation (the id an actor
    draws when it starts, e.g. `SamplerActor.incarnation`) answering for the same role and index.
    Failed calls are not restarts: the nine calls in flight when one sampler dies are one restart.

        restarts.observe("sampler", i, incarnation)        # on every answer of sampler i
        metrics["threepo_actor_restarts_total"].inc(restarts.take("sampler"), role="sampler")
    """

    def __init__(self) -> None:
        self._incarnation: dict[tuple[str, int], str] = {}
        self._unreported: dict[str, int] = {}
        self.total: dict[str, int] = {}

    def observe(self, role: str, index: int, incarnation: str) -> bool:
        """Record who answered; True when it is a restart (another incarnation answered before)."""
        previous = self._incarnation.setdefault((role, index), incarnation)
        if previous == incarnation:
            return False
        self._incarnation[(role, index)] = incarnation
        self._unreported[role] = self._unreported.get(role, 0) + 1
        self.total[role] = self.total.get(role, 0) + 1
        return True

    def take(self, role: str) -> int:
        """Restarts of `role` seen since the last `take` (what to add to the counter)."""
        return self._unreported.pop(role, 0)


def peak_rss() -> int:
    """Peak resident memory of this process (bytes): what a role took at its most (its shared pages
    of Ray's object store included where it read them; a learner's drift process is its own)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def return_free_memory() -> bool:
    """Hand the pages this process's C heap holds free back to the OS (glibc's `malloc_trim(0)`); True
    where it could. torch's CPU tensors under 32 MB come from that heap, and glibc keeps what they
    freed: a 135M model's learner rested 1.3 GB above its live tensors between steps (measured in
    benchmarks/real_model.py's memory part), the sum the machine's peak adds up. ~0.1 s for that
    much; nothing where the C library has no `malloc_trim` (macOS, musl)."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
