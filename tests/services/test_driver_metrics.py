"""Driver-side metrics helpers: a checkpoint write is timed into `threepo_checkpoint_seconds`;
actor restarts are counted once per new incarnation, not once per failed call; the standalone
Prometheus server listens on loopback unless asked otherwise."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from threepo.deploy.checkpoints import timed_write
from threepo.deploy.metrics import RestartCounter
from threepo.services.checkpoint import latest_checkpoint
from threepo.services.metrics import PrometheusMetrics


def _sample(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_checkpoint_write_is_recorded_in_checkpoint_seconds(tmp_path):
    prom = PrometheusMetrics()
    for step in (1, 2):
        path = timed_write(str(tmp_path), step, {"big.bin": b"x" * (1 << 20)}, {"version": step}, keep=2,
                           metrics=prom)
    text = prom.exposition()
    assert _sample(text, "threepo_checkpoint_seconds_count") == 2
    assert _sample(text, "threepo_checkpoint_seconds_sum") > 0
    assert str(latest_checkpoint(str(tmp_path))) == path


def test_restarts_are_counted_per_new_incarnation_not_per_failed_call():
    restarts = RestartCounter()
    assert not restarts.observe("sampler", 0, "aaaa")  # first answer: no restart
    assert not restarts.observe("sampler", 1, "bbbb")
    # nine failed calls to sampler 0 are not observed at all; its restarted actor answers:
    assert restarts.observe("sampler", 0, "cccc")
    for _ in range(5):
        assert not restarts.observe("sampler", 0, "cccc")
    assert restarts.take("sampler") == 1 and restarts.take("sampler") == 0
    assert restarts.observe("sampler", 0, "dddd") and restarts.observe("verifier", 0, "x") is False
    assert restarts.take("sampler") == 1 and restarts.total == {"sampler": 2}


def outward_ip() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def reachable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((ip, port)) == 0


def test_the_prometheus_server_listens_on_loopback_by_default():
    ip = outward_ip()
    if ip is None:
        pytest.skip("no non-loopback address to check from")
    for addr, outside in (("127.0.0.1", False), ("0.0.0.0", True)):
        prom = PrometheusMetrics()
        port = prom.serve(0) if addr == "127.0.0.1" else prom.serve(0, addr=addr)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200
            assert reachable(ip, port) is outside
        finally:
            prom.close()
