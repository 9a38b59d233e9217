"""The drift forward's process beside the learner (services/beside.py): nothing outlives a learner
that dies without cleaning up. (Its results against the inline forward: tests/services/test_learner.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil


def test_a_learner_killed_at_once_leaves_neither_its_process_nor_its_shared_file(tiny_dense_path):
    # the learner's process dies (os._exit: no finalizers) before its helper has even loaded the model;
    # the helper must still unlink the shared file, then exit on the end of its stdin
    code = f"""
import os, sys
from threepo.services.beside import BesideProcess
from threepo.services.modeling import load_model, trainable_named_parameters
b = BesideProcess({tiny_dense_path!r}, trainable_named_parameters(load_model({tiny_dense_path!r})), 1.0)
print(b.path, b.proc.pid, flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    path, pid = out.stdout.split()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (os.path.exists(path) or psutil.pid_exists(int(pid))):
        try:
            psutil.Process(int(pid)).wait(timeout=1)  # reaped here if it is our grandchild no more
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    assert not os.path.exists(path), "the shared file outlived both processes"
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
