"""The Grafana dashboard of a run, generated from the metric catalogue (services/metrics.py).

    python -m threepo.deploy.dashboard            # rewrites deploy/k8s/base/dashboards/threepo.json
    python -m threepo.deploy.dashboard --check    # exits 1 if that file is not what this generates

One panel per `CATALOGUE` metric, in the row `ROWS` names for it (a metric no row names goes to a
last row, "Other"); a row naming a metric the catalogue lacks is an error. The dashboard therefore
cannot drift from what the code exports: tests/deploy/test_dashboard.py regenerates the file and
compares it with the committed one.

Queries use the names Prometheus sees from Ray's metrics agent (checked against Ray 2.60's
exposition): `ray_` + the catalogue name; counters keep their `_total` (RayMetrics registers
`threepo_x_total` as `threepo_x` and Ray adds `_total` back); histograms are `_bucket`, `_sum`,
`_count`. Every query filters on `ray_io_cluster`, the label the PodMonitors copy from the pods'
`ray.io/cluster` label (deploy/k8s/base/podmonitors.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from threepo.services.metrics import CATALOGUE, MetricSpec

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "k8s", "base", "dashboards", "threepo.json")
RAY_PREFIX = "ray_"
SELECTOR = 'ray_io_cluster=~"$cluster"'
# Row title -> catalogue metrics shown in it, in order.
ROWS: dict[str, tuple[str, ...]] = {
    "Learning": ("threepo_reward_mean", "threepo_learner_step", "threepo_policy_version",
                 "threepo_zero_advantage_groups_ratio", "threepo_rescued_groups_total",
                 "threepo_malformed_rollouts_ratio", "threepo_kl", "threepo_ess_ratio",
                 "threepo_staleness_steps", "threepo_learner_step_seconds"),
    "Sampling": ("threepo_tokens_generated_total", "threepo_completions_total", "threepo_queue_depth"),
    "Weight sync": ("threepo_sync_events_total", "threepo_sync_bytes_total", "threepo_sync_seconds",
                    "threepo_served_noise_ratio", "threepo_noise_scale", "threepo_noise_kl",
                    "threepo_noise_redraws_total"),
    "Verifiers": ("threepo_verifier_results_total", "threepo_verifier_latency_seconds"),
    "Reliability": ("threepo_rejected_completions_total", "threepo_weight_check_failures_total",
                    "threepo_actor_restarts_total", "threepo_checkpoint_seconds"),
}
# Gauges whose series add up across label values and processes (the rest are read with max).
SUMMED_GAUGES = ("threepo_queue_depth",)
STAT_GAUGES = ("threepo_learner_step", "threepo_policy_version")
QUANTILES = (0.5, 0.95)


def exported_names(spec: MetricSpec) -> tuple[str, ...]:
    """The series names Prometheus scrapes for one catalogue metric exported through Ray."""
    base = RAY_PREFIX + spec.name
    if spec.kind == "histogram":
        return (base + "_bucket", base + "_sum", base + "_count")
    return (base,)


def _by(labels: tuple[str, ...]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def _legend(labels: tuple[str, ...]) -> str:
    return " ".join("{{" + label + "}}" for label in labels) or "{{ray_io_cluster}}"


def _unit(spec: MetricSpec) -> str:
    name = spec.name.removesuffix("_total")
    if name.endswith("_seconds"):
        return "s"
    if name.endswith("_bytes"):
        return "Bps" if spec.kind == "counter" else "bytes"
    if name.endswith("_ratio"):
        return "percentunit"
    return "ops" if spec.kind == "counter" else "short"


def targets(spec: MetricSpec) -> list[dict[str, str]]:
    """PromQL of one metric's panel: a rate for counters, the value for gauges, quantiles for histograms."""
    series = f"{exported_names(spec)[0]}{{{SELECTOR}}}"
    labels = spec.labels
    if spec.kind == "counter":
        return [{"expr": f"sum{_by(labels)} (rate({series}[$__rate_interval]))", "legendFormat": _legend(labels)}]
    if spec.kind == "gauge":
        agg = "sum" if spec.name in SUMMED_GAUGES else "max"
        return [{"expr": f"{agg}{_by(labels)} ({series})", "legendFormat": _legend(labels)}]
    inner = f"sum{_by(('le',) + labels)} (rate({series}[$__rate_interval]))"
    return [{"expr": f"histogram_quantile({q}, {inner})",
             "legendFormat": f"p{round(q * 100)} {_legend(labels)}".strip()} for q in QUANTILES]


def panel(spec: MetricSpec, panel_id: int, x: int, y: int) -> dict[str, Any]:
    stat = spec.name in STAT_GAUGES
    kind = {"counter": "per second", "gauge": "", "histogram": "quantiles"}[spec.kind]
    return {
        "id": panel_id, "type": "stat" if stat else "timeseries",
        "title": spec.name.removeprefix("threepo_").removesuffix("_total") + (f" ({kind})" if kind else ""),
        "description": spec.doc, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": _unit(spec)}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}} if stat else {"legend": {"displayMode": "list"}},
        "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets(spec))],
    }


def rows(catalogue: tuple[MetricSpec, ...] = CATALOGUE) -> dict[str, tuple[str, ...]]:
    """`ROWS`, checked against the catalogue, plus "Other" for catalogue metrics no row names."""
    placed = [name for names in ROWS.values() for name in names]
    known = [spec.name for spec in catalogue]
    unknown = sorted(set(placed) - set(known))
    twice = sorted({name for name in placed if placed.count(name) > 1})
    if unknown or twice:
        raise ValueError(f"deploy/dashboard.py ROWS: not in services/metrics.py CATALOGUE {unknown}, "
                         f"in two rows {twice}")
    other = tuple(name for name in known if name not in placed)
    return {**ROWS, "Other": other} if other else dict(ROWS)


def build(catalogue: tuple[MetricSpec, ...] = CATALOGUE) -> dict[str, Any]:
    """The dashboard JSON model (Grafana schema 39)."""
    by_name = {spec.name: spec for spec in catalogue}
    panels: list[dict[str, Any]] = []
    y = 0
    for title, names in rows(catalogue).items():
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, name in enumerate(names):
            panels.append(panel(by_name[name], len(panels) + 1, 8 * (i % 3), y + 8 * (i // 3)))
        y += 8 * ((len(names) + 2) // 3)
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        {"name": "cluster", "label": "RayCluster", "type": "query", "includeAll": True, "multi": True,
         "allValue": ".*",
         "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
         "query": {"query": f"label_values({RAY_PREFIX}threepo_learner_step, ray_io_cluster)",
                   "refId": "cluster"},
         "definition": f"label_values({RAY_PREFIX}threepo_learner_step, ray_io_cluster)"},
    ]
    return {"uid": "threepo", "title": "threepo run", "tags": ["threepo", "ray"], "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
            "templating": {"list": variables}, "panels": panels}


def render(catalogue: tuple[MetricSpec, ...] = CATALOGUE) -> str:
    """The dashboard file's exact text."""
    return json.dumps(build(catalogue), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="generate the Grafana dashboard from the metric catalogue")
    parser.add_argument("--out", default=DEFAULT_OUT, help="file to write (default: the kustomize base's)")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what is generated")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = open(args.out).read() if os.path.exists(args.out) else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m threepo.deploy.dashboard", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
