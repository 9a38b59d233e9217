"""The local cluster's start is tried again when Ray's node misses its 30 s registration window (a
busy machine), after the half-started node's processes are stopped; any other error, and the last
try's, propagate. `ray.init` is replaced here: the real start is covered by the integration tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from threepo.deploy import cluster

TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


def fake_init(outcomes: list, spawned: list):
    def init(address=None, **kwargs):
        assert address == "local"
        # a half-started node leaves a process behind, as Ray's GCS and raylet would
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
    return init


def test_a_start_that_times_out_is_tried_again_after_its_processes_are_stopped(monkeypatch, capsys):
    spawned: list = []
    monkeypatch.setattr(cluster.ray, "init", fake_init([TIMEOUT, None], spawned))
    cluster._start_local(num_cpus=1)
    assert len(spawned) == 2
    assert spawned[0].poll() is not None  # the first try's process was stopped
    assert spawned[1].poll() is None  # the started node is left running
    assert "starting it again" in capsys.readouterr().out
    spawned[1].kill()
    spawned[1].wait()


@pytest.mark.parametrize("outcomes", [[RuntimeError("GCS address bad")], [TIMEOUT] * cluster.STARTUP_TRIES])
def test_other_errors_and_the_last_timeout_propagate(monkeypatch, outcomes):
    spawned: list = []
    monkeypatch.setattr(cluster.ray, "init", fake_init(list(outcomes), spawned))
    with pytest.raises(Exception) as raised:
        cluster._start_local(num_cpus=1)
    assert raised.value is outcomes[-1]
    assert len(spawned) == len(outcomes)
    for proc in spawned:
        proc.kill()
        proc.wait()
