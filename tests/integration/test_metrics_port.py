"""The local cluster's metrics port: the documented default (`runtime.metrics_port`, 8090) on
loopback only, a free one (said so) when it is taken, every interface only when asked. Each case
starts its own Ray cluster in a subprocess (the session's cluster is already up in this one)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from threepo.deploy.runtime_config import RuntimeConfig

pytestmark = pytest.mark.ray

SCRIPT = """
import json, socket, sys, urllib.request
import ray
from threepo.deploy.cluster import init_ray
from threepo.deploy.config import load_config
init_ray(load_config(None, sys.argv[1:]))
port = ray.nodes()[0]["MetricsExportPort"]
with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
    status = r.status
outside = None
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
    try:
        u.connect(("192.0.2.1", 9))  # TEST-NET-1: sends nothing, finds the default route's address
        ip = u.getsockname()[0]
    except OSError:
        ip = "127.0.0.1"
if not ip.startswith("127."):
    with socket.socket() as s:
        s.settimeout(2)
        outside = s.connect_ex((ip, port)) == 0
print(json.dumps({"port": port, "status": status, "outside": outside}))
ray.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*overrides: str) -> tuple[dict, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, *overrides], capture_output=True, text=True,
                            timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


def test_default_metrics_port_is_documented_and_on_loopback_unless_asked():
    assert RuntimeConfig().metrics_port == 8090 and RuntimeConfig().metrics_host == "127.0.0.1"
    port = free_port()
    info, out = start(f"runtime.metrics_port={port}")
    assert info["port"] == port and info["status"] == 200 and info["outside"] in (False, None)
    assert f"Prometheus metrics at http://127.0.0.1:{port}/metrics" in out
    if info["outside"] is None:
        pytest.skip("no non-loopback address to check the binding from")
    info, _ = start(f"runtime.metrics_port={free_port()}", "runtime.metrics_host=0.0.0.0")
    assert info["outside"] is True


def test_a_taken_metrics_port_falls_back_to_a_free_one_and_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        info, out = start(f"runtime.metrics_port={port}")
    assert info["port"] != port and info["status"] == 200
    assert f"(runtime.metrics_port={port} was taken)" in out
