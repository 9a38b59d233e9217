"""The Grafana dashboard stays in step with the metric catalogue: the committed file is what
deploy/dashboard.py generates, every panel queries a series the catalogue exports, every catalogue
metric has a panel, and the exported names are the ones Ray's metrics agent really serves."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from threepo.deploy import dashboard
from threepo.services.metrics import CATALOGUE, MetricSpec

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "deploy" / "k8s" / "base" / "dashboards" / "threepo.json"
SERIES = re.compile(r"\bray_threepo_[a-z0-9_]+")
LABEL_VALUES = {"engine_id": "0", "role": "sampler", "algorithm": "c3po", "status": "ok", "reason": "budget",
                "verifier": "math"}


def _queries(board: dict) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"] if p["type"] != "row"}


def test_committed_dashboard_is_the_generated_one():
    assert COMMITTED.read_text() == dashboard.render(), \
        "deploy/k8s/base/dashboards/threepo.json is stale: run python -m threepo.deploy.dashboard"
    assert dashboard.main(["--check", "--out", str(COMMITTED)]) == 0


def test_check_mode_reports_a_stale_file(tmp_path):
    stale = tmp_path / "threepo.json"
    stale.write_text(COMMITTED.read_text().replace("reward_mean", "reward_avg"))
    assert dashboard.main(["--check", "--out", str(stale)]) == 1
    assert dashboard.main(["--out", str(stale)]) == 0 and stale.read_text() == dashboard.render()


def test_every_panel_queries_catalogue_series_and_every_metric_has_a_panel():
    board = json.loads(COMMITTED.read_text())
    exported = {name: spec for spec in CATALOGUE for name in dashboard.exported_names(spec)}
    used = set()
    for title, exprs in _queries(board).items():
        assert exprs, title
        for expr in exprs:
            names = SERIES.findall(expr)
            assert names and all(n in exported for n in names), f"panel {title!r} queries {names}"
            assert 'ray_io_cluster=~"$cluster"' in expr, title
            used.update(exported[n].name for n in names)
    assert used == {spec.name for spec in CATALOGUE}, f"no panel for {sorted({s.name for s in CATALOGUE} - used)}"


def test_queries_fit_each_kind():
    for spec in CATALOGUE:
        exprs = [t["expr"] for t in dashboard.targets(spec)]
        if spec.kind == "counter":
            assert exprs == [f"sum by ({', '.join(spec.labels)}) (rate(ray_{spec.name}"
                             f"{{ray_io_cluster=~\"$cluster\"}}[$__rate_interval]))".replace("sum by () ", "sum ")]
        elif spec.kind == "histogram":
            assert len(exprs) == 2 and all(e.startswith("histogram_quantile(") and f"ray_{spec.name}_bucket" in e
                                           and "le" in e for e in exprs)
        else:
            assert exprs[0].endswith(f"(ray_{spec.name}{{ray_io_cluster=~\"$cluster\"}})")


def test_rows_reject_a_metric_the_catalogue_lacks(monkeypatch):
    monkeypatch.setitem(dashboard.ROWS, "Sampling", dashboard.ROWS["Sampling"] + ("threepo_gone_total",))
    with pytest.raises(ValueError, match="threepo_gone_total"):
        dashboard.build()


def test_a_new_catalogue_metric_gets_a_panel():
    extra = MetricSpec("gauge", "threepo_new_thing_ratio", "A metric no row names yet.", ("role",))
    board = dashboard.build(CATALOGUE + (extra,))
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows[-1] == "Other"
    assert any("ray_threepo_new_thing_ratio" in e for exprs in _queries(board).values() for e in exprs)


@pytest.mark.ray
@pytest.mark.slow
def test_exported_names_are_what_ray_serves(ray_session):
    """Record every catalogue metric in an actor; Ray's metrics agent serves exactly the names the
    dashboard queries (`ray_` prefix, counters ending in `_total`, histogram `_bucket`)."""
    from threepo.deploy.metrics import RayMetrics

    class Recorder:  # defined here so cloudpickle ships it by value
        def record(self, values: dict) -> None:
            from threepo.services.metrics import register_catalogue

            handles = register_catalogue(RayMetrics())
            for spec in CATALOGUE:
                labels = {k: values[k] for k in spec.labels}
                {"counter": lambda h: h.inc(1, **labels), "gauge": lambda h: h.set(0.5, **labels),
                 "histogram": lambda h: h.observe(0.3, **labels)}[spec.kind](handles[spec.name])

    actor = ray_session.remote(num_cpus=0)(Recorder).remote()
    ray_session.get(actor.record.remote(LABEL_VALUES), timeout=60)
    node = next(n for n in ray_session.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    expected = {name for spec in CATALOGUE for name in dashboard.exported_names(spec)}
    deadline, served = time.monotonic() + 90, set()
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        served = {m.group(1) for m in re.finditer(r"^(ray_threepo_[a-z0-9_]+)[{ ]", text, re.M)}
        if expected <= served:
            break
        time.sleep(1)
    ray_session.kill(actor)
    assert expected <= served, f"not served by Ray: {sorted(expected - served)}"
