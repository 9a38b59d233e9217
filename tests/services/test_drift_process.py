"""The drift forward's process beside the learner (services/learner/drift_process.py): nothing outlives a learner
that dies without cleaning up. (Its results against the inline forward: tests/services/test_learner.py.)"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil


def test_the_shared_buffers_have_no_name_and_the_process_outlives_no_learner(tiny_dense_path):
    # the learner's process dies (os._exit: no finalizers) before its helper has even loaded the model:
    # no file may be left in /dev/shm (there is none from the start), and the helper must exit on the
    # end of its stdin
    code = f"""
import os, tempfile
from threepo.services.learner.drift_process import DriftProcess
from threepo.services.model.modeling import load_model, trainable_named_parameters
folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
before = set(os.listdir(folder))
b = DriftProcess({tiny_dense_path!r}, trainable_named_parameters(load_model({tiny_dense_path!r})), 1.0)
left = [f for f in set(os.listdir(folder)) - before if f.startswith("threepo-beside-")]
print(len(left), b.proc.pid, flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    left, pid = (int(x) for x in out.stdout.split())
    assert left == 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.2)
        except psutil.NoSuchProcess:
            break
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
