"""A small metrics facade: services record metrics without knowing where they go.

A service takes a `Metrics` (a Protocol) and asks it for counters, gauges and histograms. Three
implementations share the rules below:
- `PrometheusMetrics` (here): prometheus_client with a private `CollectorRegistry` and its own HTTP
  server (`serve(port)`), for runs without Ray (operations.md §2.2, prime-rl's pattern);
- `RayMetrics` (deploy/metrics.py): `ray.util.metrics`, exported by Ray's per-node agent;
- `NullMetrics` (here): checks names and labels, records nothing (tests, tools).

Rules (operations.md §2.1), checked when a metric is made, so a bad name fails in a unit test and
not silently at scrape time: names are `threepo_` + snake_case in base units (seconds, bytes,
ratios in [0, 1]; no `_ms`, `_mb`, `_percent`); counters, and only counters, end in `_total`;
labels come from the bounded set `ALLOWED_LABELS` (never a prompt, rollout or completion id, each
of which would be a new time series); histogram buckets are positive and increasing (Ray refuses
non-positive ones). Label values are checked on every record: exactly the declared label names.

`CATALOGUE` lists what the runtime exports (architecture.md §7);
`register_catalogue(metrics)` makes all of it up front so every series exists from the start.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ALLOWED_LABELS = ("role", "engine_id", "algorithm", "status", "reason", "verifier")
KINDS = ("counter", "gauge", "histogram")
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Staleness is an integer number of learner steps; half-integer edges give one bucket per value
# (le=0.5 counts on-policy rollouts) while staying positive, as Ray's histograms require.
STALENESS_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5)
_NAME = re.compile(r"^threepo_[a-z][a-z0-9]*(_[a-z0-9]+)*$")
_NON_BASE_UNITS = ("ms", "us", "ns", "millis", "milliseconds", "microseconds", "nanoseconds", "minutes",
                   "hours", "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "gigabytes",
                   "percent", "pct")


class Counter(Protocol):
    def inc(self, value: float = 1.0, **labels: str | int) -> None: ...


class Gauge(Protocol):
    def set(self, value: float, **labels: str | int) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, **labels: str | int) -> None: ...


class Metrics(Protocol):
    """Where a service's metrics go. Asking twice for the same metric returns the same handle."""

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter: ...

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge: ...

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = SECONDS_BUCKETS) -> Histogram: ...


@dataclass(frozen=True)
class MetricSpec:
    """One metric: kind (counter, gauge or histogram), name, help text, label names, buckets."""

    kind: str
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        check_spec(self)


def check_spec(spec: MetricSpec) -> None:
    """Raise ValueError naming the metric and the rule it breaks (see the module docstring)."""
    name = spec.name
    if spec.kind not in KINDS:
        raise ValueError(f"metric {name!r}: kind must be one of {KINDS}, got {spec.kind!r}")
    if not _NAME.match(name):
        raise ValueError(f"metric {name!r}: expected a snake_case name prefixed 'threepo_'")
    words = name.split("_")
    bad_units = [w for w in words if w in _NON_BASE_UNITS]
    if bad_units:
        raise ValueError(f"metric {name!r}: use base units (seconds, bytes, ratio in [0, 1]), not {bad_units}")
    if (spec.kind == "counter") != name.endswith("_total"):
        raise ValueError(f"metric {name!r}: counters and only counters end in '_total' (kind {spec.kind})")
    if not spec.doc.strip():
        raise ValueError(f"metric {name!r}: doc must say what is measured")
    for label in spec.labels:
        if label not in ALLOWED_LABELS:
            raise ValueError(f"metric {name!r}: label {label!r} is not a bounded label; expected one of "
                             f"{ALLOWED_LABELS} (ids such as prompt, rollout or completion ids never are labels)")
    if len(set(spec.labels)) != len(spec.labels):
        raise ValueError(f"metric {name!r}: repeated label in {spec.labels}")
    if spec.kind == "histogram":
        edges = spec.buckets
        if not edges or edges[0] <= 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"metric {name!r}: buckets must be positive and increasing, got {edges}")
    elif spec.buckets:
        raise ValueError(f"metric {name!r}: only histograms take buckets")


def label_values(spec: MetricSpec, values: dict[str, Any]) -> dict[str, str]:
    """Check that a record names exactly the metric's labels; return them as strings."""
    if set(values) != set(spec.labels):
        raise ValueError(f"metric {spec.name!r}: expected label values for {list(spec.labels)}, "
                         f"got {sorted(values)}")
    return {k: str(values[k]) for k in spec.labels}


def check_value(spec: MetricSpec, value: float) -> float:
    value = float(value)
    if spec.kind == "counter" and not value >= 0:
        raise ValueError(f"metric {spec.name!r}: a counter only goes up, got inc({value})")
    return value


class HandleCache:
    """The handles a backend has made, by name: the same spec returns the same handle, a
    conflicting one (other kind, labels or buckets) raises."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[MetricSpec, Any]] = {}

    def get(self, spec: MetricSpec, make: Callable[[MetricSpec], Any]) -> Any:
        if spec.name in self._made:
            known, handle = self._made[spec.name]
            if (known.kind, known.labels, known.buckets) != (spec.kind, spec.labels, spec.buckets):
                raise ValueError(f"metric {spec.name!r}: already made as {known.kind} with labels "
                                 f"{known.labels} and buckets {known.buckets}; asked for {spec.kind} "
                                 f"with {spec.labels} and {spec.buckets}")
            return handle
        handle = make(spec)
        self._made[spec.name] = (spec, handle)
        return handle


class _PromHandle:
    """One prometheus_client metric behind the facade's inc/set/observe."""

    def __init__(self, spec: MetricSpec, metric: Any) -> None:
        self.spec, self._metric = spec, metric

    def _child(self, values: dict[str, Any]) -> Any:
        labelled = label_values(self.spec, values)
        return self._metric.labels(**labelled) if labelled else self._metric

    def inc(self, value: float = 1.0, **labels: str | int) -> None:
        self._child(labels).inc(check_value(self.spec, value))

    def set(self, value: float, **labels: str | int) -> None:
        self._child(labels).set(check_value(self.spec, value))

    def observe(self, value: float, **labels: str | int) -> None:
        self._child(labels).observe(check_value(self.spec, value))


class PrometheusMetrics:
    """Metrics on prometheus_client with a private registry; `serve` exposes it over HTTP."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self._cache = HandleCache()
        self._server: Any = None

    def _make(self, spec: MetricSpec) -> _PromHandle:
        import prometheus_client as pc

        common = dict(name=spec.name, documentation=spec.doc, labelnames=spec.labels, registry=self.registry)
        if spec.kind == "counter":
            metric = pc.Counter(**common)
        elif spec.kind == "gauge":
            metric = pc.Gauge(**common)
        else:
            metric = pc.Histogram(**common, buckets=spec.buckets)
        return _PromHandle(spec, metric)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._cache.get(MetricSpec("counter", name, doc, tuple(labels)), self._make)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._cache.get(MetricSpec("gauge", name, doc, tuple(labels)), self._make)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = SECONDS_BUCKETS) -> Histogram:
        spec = MetricSpec("histogram", name, doc, tuple(labels), tuple(float(b) for b in buckets))
        return self._cache.get(spec, self._make)

    def exposition(self) -> str:
        """The registry in Prometheus text format (what `/metrics` serves)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on `addr:port` from a daemon thread; port 0 picks a free port. Returns the
        port. Loopback by default; pass addr="0.0.0.0" for a Prometheus on another machine."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError(f"PrometheusMetrics already serving on port {self._server.server_port}")
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop the HTTP server, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _NullHandle:
    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec

    def inc(self, value: float = 1.0, **labels: str | int) -> None:
        label_values(self.spec, labels)
        check_value(self.spec, value)

    def set(self, value: float, **labels: str | int) -> None:
        label_values(self.spec, labels)
        check_value(self.spec, value)

    def observe(self, value: float, **labels: str | int) -> None:
        label_values(self.spec, labels)
        check_value(self.spec, value)


class NullMetrics:
    """Checks names, labels and values like the real backends, and records nothing."""

    def __init__(self) -> None:
        self._cache = HandleCache()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._cache.get(MetricSpec("counter", name, doc, tuple(labels)), _NullHandle)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._cache.get(MetricSpec("gauge", name, doc, tuple(labels)), _NullHandle)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = SECONDS_BUCKETS) -> Histogram:
        spec = MetricSpec("histogram", name, doc, tuple(labels), tuple(float(b) for b in buckets))
        return self._cache.get(spec, _NullHandle)


def _c(name: str, doc: str, *labels: str) -> MetricSpec:
    return MetricSpec("counter", name, doc, labels)


def _g(name: str, doc: str, *labels: str) -> MetricSpec:
    return MetricSpec("gauge", name, doc, labels)


def _h(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> MetricSpec:
    return MetricSpec("histogram", name, doc, labels, buckets)


# What the runtime exports (architecture.md §7). Ray adds its `ray_` prefix on top.
CATALOGUE: tuple[MetricSpec, ...] = (
    _c("threepo_tokens_generated_total", "Completion tokens generated by a sampler engine.", "engine_id"),
    _c("threepo_completions_total", "Completions streamed by a sampler engine.", "engine_id"),
    _g("threepo_queue_depth", "Items waiting in a role's input queue (sampler requests, verifier "
       "completions, learner groups).", "role"),
    _h("threepo_staleness_steps", "Learner step at consumption minus the step that published the "
       "rollout's policy version.", STALENESS_BUCKETS, "algorithm"),
    _c("threepo_sync_events_total", "Posterior versions published, by reason (budget, max_staleness, "
       "init, resume).", "reason"),
    _c("threepo_sync_bytes_total", "Bytes of (mean, sigma) sent to a sampler engine for new versions.",
       "engine_id"),
    _h("threepo_sync_seconds", "Time for a sampler engine to take a new version.", SECONDS_BUCKETS, "engine_id"),
    _g("threepo_served_noise_ratio", "Perturbation that survives the served dtype, ||theta_served - "
       "m_served|| / ||sigma * z||, of the slot an engine serves now (1 in fp32).", "engine_id"),
    _g("threepo_engine_busy_ratio", "Fraction of the last learner step's wall time a sampler engine spent "
       "generating.", "engine_id"),
    _c("threepo_busy_seconds_total", "Seconds a role spent working: samplers generating, verifiers "
       "verifying, the learner stepping.", "role"),
    _c("threepo_learner_wait_seconds_total", "Seconds the learner sat idle waiting for a step's groups."),
    _c("threepo_weight_check_failures_total", "Weight checks an engine failed (reason: mean = received "
       "mean differs from the published one, load = backend holds other values than fed, changed = "
       "served weights changed while serving).", "engine_id", "reason"),
    _h("threepo_verifier_latency_seconds", "Time to verify one completion.", SECONDS_BUCKETS, "verifier", "status"),
    _c("threepo_verifier_results_total", "Verification results by status; infra_error never reaches "
       "the gradient.", "verifier", "status"),
    _g("threepo_zero_advantage_groups_ratio", "Fraction of the step's groups whose advantages are all "
       "zero (no learning signal).", "algorithm"),
    _c("threepo_rescued_groups_total", "Groups with a learning signal only thanks to exploration across "
       "slots (all-equal rewards within each slot).", "algorithm"),
    _g("threepo_malformed_rollouts_ratio", "Fraction of the step's completions verified as malformed.",
       "algorithm"),
    _g("threepo_reward_mean", "Mean reward of the step's completions.", "algorithm"),
    _g("threepo_kl", "KL estimate between the learner policy and the behaviour policies of the step.",
       "algorithm"),
    _g("threepo_ess_ratio", "Effective sample size of the step's importance weights divided by the "
       "number of completions.", "algorithm"),
    _g("threepo_noise_scale", "Sigma scale c the latest version's slots serve (theta = m + c * sigma * z; noise control).",
       "algorithm"),
    _g("threepo_noise_kl", "Median per-token KL of the latest version's slots to the mean, on the noise control's probe.",
       "algorithm"),
    _c("threepo_noise_redraws_total", "Slots redrawn by the noise KL gate.", "algorithm"),
    _h("threepo_learner_step_seconds", "Wall time of one learner step.", SECONDS_BUCKETS, "algorithm"),
    _g("threepo_learner_step", "Learner steps taken."),
    _g("threepo_policy_version", "Latest published posterior version."),
    _c("threepo_rejected_completions_total", "Completions refused by the learner (checksum mismatch, "
       "duplicate id, sequence gap).", "reason"),
    _c("threepo_actor_restarts_total", "Actor restarts seen by the driver.", "role"),
    _h("threepo_checkpoint_seconds", "Time to write one checkpoint.", SECONDS_BUCKETS),
)


def register_catalogue(metrics: Metrics, catalogue: Sequence[MetricSpec] = CATALOGUE) -> dict[str, Any]:
    """Make every metric of `catalogue` on `metrics`; return the handles by name."""
    handles: dict[str, Any] = {}
    for spec in catalogue:
        if spec.kind == "counter":
            handles[spec.name] = metrics.counter(spec.name, spec.doc, spec.labels)
        elif spec.kind == "gauge":
            handles[spec.name] = metrics.gauge(spec.name, spec.doc, spec.labels)
        else:
            handles[spec.name] = metrics.histogram(spec.name, spec.doc, spec.labels, spec.buckets)
    return handles
