"""Metrics facade: Prometheus exposition over HTTP carries the recorded values; bad names, labels
and values are refused the same way by every backend."""

from __future__ import annotations

import urllib.request

import pytest

from threepo.services.metrics import (
    CATALOGUE, STALENESS_BUCKETS, MetricSpec, NullMetrics, PrometheusMetrics, register_catalogue,
)


@pytest.fixture
def prom():
    metrics = PrometheusMetrics()
    yield metrics
    metrics.close()


def test_prometheus_serves_recorded_values_on_a_free_port(prom):
    tokens = prom.counter("threepo_tokens_generated_total", "tokens", ["engine_id"])
    depth = prom.gauge("threepo_queue_depth", "queue", ["role"])
    latency = prom.histogram("threepo_verifier_latency_seconds", "latency", ["status"], buckets=[0.1, 1.0])
    tokens.inc(120, engine_id=0)
    tokens.inc(5, engine_id=0)
    tokens.inc(7, engine_id=1)
    depth.set(3, role="learner")
    for seconds in (0.05, 0.5, 0.7, 4.0):
        latency.observe(seconds, status="ok")

    port = prom.serve(0)
    assert port > 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'threepo_tokens_generated_total{engine_id="0"} 125.0' in text
    assert 'threepo_tokens_generated_total{engine_id="1"} 7.0' in text
    assert 'threepo_queue_depth{role="learner"} 3.0' in text
    assert 'threepo_verifier_latency_seconds_bucket{le="0.1",status="ok"} 1.0' in text
    assert 'threepo_verifier_latency_seconds_bucket{le="1.0",status="ok"} 3.0' in text
    assert 'threepo_verifier_latency_seconds_count{status="ok"} 4.0' in text
    assert "# HELP threepo_queue_depth queue" in text
    with pytest.raises(RuntimeError, match="already serving"):
        prom.serve(0)


def test_each_instance_has_its_own_registry(prom):
    other = PrometheusMetrics()
    prom.gauge("threepo_learner_step", "step").set(4)
    other.gauge("threepo_learner_step", "step").set(9)  # no 'Duplicated timeseries' across instances
    assert "threepo_learner_step 4.0" in prom.exposition()
    assert "threepo_learner_step 9.0" in other.exposition()


@pytest.mark.parametrize("backend", [NullMetrics, PrometheusMetrics])
@pytest.mark.parametrize("kind,name,labels,match", [
    ("counter", "tokens_total", (), "prefixed 'threepo_'"),
    ("counter", "threepo_TokensTotal", (), "snake_case"),
    ("histogram", "threepo_verify_latency_ms", (), r"base units .*\['ms'\]"),
    ("gauge", "threepo_sync_mb", (), r"base units .*\['mb'\]"),
    ("counter", "threepo_completions", (), "counters and only counters end in '_total'"),
    ("gauge", "threepo_queue_depth_total", (), "counters and only counters end in '_total'"),
    ("counter", "threepo_completions_total", ("completion_id",), "'completion_id' is not a bounded label"),
    ("gauge", "threepo_reward_mean", ("prompt",), "'prompt' is not a bounded label"),
    ("counter", "threepo_rollouts_total", ("rollout_id",), "never are labels"),
    ("counter", "threepo_rollouts_total", ("role", "role"), "repeated label"),
])
def test_bad_names_and_labels_are_refused(backend, kind, name, labels, match):
    with pytest.raises(ValueError, match=match):
        getattr(backend(), kind)(name, "doc", labels)


def test_bad_buckets_values_and_label_values_are_refused(prom):
    with pytest.raises(ValueError, match="buckets must be positive and increasing"):
        prom.histogram("threepo_staleness_steps", "s", buckets=[0, 1, 2])
    with pytest.raises(ValueError, match="buckets must be positive and increasing"):
        prom.histogram("threepo_staleness_steps", "s", buckets=[1, 1])
    with pytest.raises(ValueError, match="only histograms take buckets"):
        MetricSpec("gauge", "threepo_x", "x", (), (1.0,))
    with pytest.raises(ValueError, match="doc must say"):
        prom.gauge("threepo_x", " ")
    completions = prom.counter("threepo_completions_total", "c", ["engine_id"])
    with pytest.raises(ValueError, match=r"expected label values for \['engine_id'\], got \['prompt_id'\]"):
        completions.inc(prompt_id="p17")
    with pytest.raises(ValueError, match=r"expected label values for \['engine_id'\], got \[\]"):
        completions.inc()
    with pytest.raises(ValueError, match="a counter only goes up"):
        completions.inc(-1, engine_id=0)
    assert "prompt_id" not in prom.exposition()


def test_same_metric_twice_is_one_handle_and_a_conflict_raises(prom):
    first = prom.counter("threepo_completions_total", "c", ["engine_id"])
    assert prom.counter("threepo_completions_total", "c", ("engine_id",)) is first
    with pytest.raises(ValueError, match="already made as counter"):
        prom.counter("threepo_completions_total", "c", ["role"])


def test_catalogue_is_valid_and_registers_on_every_backend(prom):
    names = [spec.name for spec in CATALOGUE]
    assert len(names) == len(set(names))
    for wanted in ("tokens_generated", "queue_depth", "staleness", "sync_events", "sync_bytes", "sync_seconds",
                   "verifier_latency", "verifier_results", "zero_advantage", "rescued", "malformed", "reward",
                   "kl", "ess", "learner_step_seconds"):
        assert any(wanted in n for n in names), wanted
    handles = register_catalogue(prom)
    assert sorted(handles) == sorted(names)
    handles["threepo_staleness_steps"].observe(0, algorithm="c3po")
    handles["threepo_staleness_steps"].observe(2, algorithm="c3po")
    handles["threepo_learner_step"].set(12)
    text = prom.exposition()
    assert 'threepo_staleness_steps_bucket{algorithm="c3po",le="0.5"} 1.0' in text
    assert 'threepo_staleness_steps_bucket{algorithm="c3po",le="2.5"} 2.0' in text
    assert "threepo_learner_step 12.0" in text
    assert "# HELP threepo_checkpoint_seconds" in text  # unlabelled metrics exist before any record
    assert sorted(register_catalogue(NullMetrics())) == sorted(names)
    assert STALENESS_BUCKETS[0] > 0
