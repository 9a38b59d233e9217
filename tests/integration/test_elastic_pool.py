"""The elastic sampler pool on a real multi-node Ray cluster on one machine: `ray start --head` with one
unit of `threepo_sampler`, `threepo train runtime.ray_address=... runtime.num_samplers=elastic` joining it;
a second node offering `threepo_sampler` joins mid-run and its sampler serves; then that node is
killed, and the run completes with admitted = consumed, every completion id once. (The tiny model
makes up to ~30 steps a second, so the run is long enough for a node to start.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_train_ray import SMALL, _exact, _kill_session, _metrics

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ray's CLI beside the running interpreter: the suite also runs from a venv that is not activated
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _node(*args, env):
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait(what, check, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(run_dir):
    return [r for r in _metrics(run_dir) if "reward_mean" in r] if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []


def test_a_sampler_node_joins_and_leaves_mid_run(tmp_path, tiny_dense_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _node("--head", f"--port={port}", "--num-cpus=2", '--resources={"threepo_sampler": 1}',
                 "--include-dashboard=false", "--node-ip-address=127.0.0.1", env=env)
    nodes = [head]
    try:
        _wait("the head", lambda: subprocess.run([RAY, "status", f"--address={address}"], env=env,
                                                 capture_output=True).returncode == 0)
        train = subprocess.Popen(
            [sys.executable, "-m", "threepo.deploy.cli", "train", f"model.path={tiny_dense_path}", f"runs_dir={tmp_path}",
             *SMALL, "runtime.steps=2400", f"runtime.ray_address={address}", "runtime.num_samplers=elastic",
             "runtime.pool_check_s=0.5", "eval.around_training=false", "runtime.max_offpolicy=2"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "train.err", "w"))  # a pipe would fill and block
        _wait("the run directory", lambda: any(tmp_path.glob("threepo-train-*")))
        (run_dir,) = tmp_path.glob("threepo-train-*")
        _wait("two steps on one sampler node", lambda: len(_rows(run_dir)) >= 2)
        assert all("tokens_per_s/engine1" not in r for r in _rows(run_dir))
        joined_at = time.monotonic()
        nodes.append(_node(f"--address={address}", "--num-cpus=1", '--resources={"threepo_sampler": 1}',
                           "--node-ip-address=127.0.0.1", env=env))
        _wait("the new node's sampler serving",
              lambda: any(r.get("tokens_per_s/engine1", 0) > 0 for r in _rows(run_dir)))
        served_after = time.monotonic() - joined_at
        _wait("steps served by both nodes", lambda: sum("tokens_per_s/engine1" in r for r in _rows(run_dir)) >= 30)
        _kill_session(nodes.pop().pid)  # the sampler node leaves, whatever it had in flight
        train.wait(timeout=600)
        assert train.returncode == 0, (tmp_path / "train.err").read_text()[-3000:]
    finally:
        for node in nodes:
            _kill_session(node.pid)
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    rows = _exact(str(run_dir), summary, 2400, 2 * 8)
    assert served_after < 90  # node start-up, sampler start-up and its first batch
    both = [i for i, r in enumerate(rows) if "tokens_per_s/engine1" in r]
    rate = lambda a, b: (rows[b]["consumed_rollouts"] - rows[a]["consumed_rollouts"]) / (rows[b]["time_s"] - rows[a]["time_s"])  # noqa: E731
    print(f"elastic pool: sampler served {served_after:.1f} s after its node started; rollouts/s with one "
          f"node {rate(5, both[0] - 1):.0f}, with two {rate(both[0] + 2, both[-1]):.0f}, after it left "
          f"{rate(both[-1] + 3, len(rows) - 1):.0f}")
    # the first node carried on alone (in any step after the other left: the last steps of an async
    # run may generate nothing, their rollouts were made ahead within the staleness bound)
    assert any(r.get("tokens_per_s/engine0", 0) > 0 for r in rows[both[-1] + 1:])
