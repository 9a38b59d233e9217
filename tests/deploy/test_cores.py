"""`runtime.pin_learner` (deploy/cores.py): which cores the learner and the rest of a local run get,
when it applies, and that real processes (a learner with a helper of its own, another role, the
driver) end up where it says and get their cores back."""

import os
import subprocess
import sys
import time

import pytest

from threepo.deploy.config import load_config
from threepo.deploy.cores import CorePlacement, descendants, drift_process, half_precision_note, split

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_the_learner_takes_the_last_cores_and_leaves_at_least_one():
    assert split({0, 1}, 1.0) == ({1}, {0})
    assert split({0, 1, 2, 3}, 2.0) == ({2, 3}, {0, 1})
    assert split({4, 6, 9}, 0.25) == ({9}, {4, 6})  # a fraction of a CPU still needs a core
    assert split({3}, 1.0) is None
    assert split({0, 1}, 2.0) is None


def test_where_it_applies_and_what_it_says_where_it_does_not(monkeypatch):
    assert str(CorePlacement(load_config(None, ["runtime.pin_learner=false"]))) == ""
    assert str(CorePlacement(load_config(None, ["runtime.ray_address=auto"]))) == ""  # the cluster's placement
    gpu = CorePlacement(load_config(None, ["learner.device=cuda"]))
    assert gpu.cores is None and "not one CPU process" in str(gpu)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    moved = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: moved.append(pid))
    alone = CorePlacement(load_config(None, []))
    assert alone.cores is None and "1 core(s), none to spare" in str(alone)
    alone.place(os.getpid())
    alone.release()
    assert moved == []


def test_the_drift_process_runs_only_with_a_core_of_its_own(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    on, why = drift_process(load_config(None, []))  # 1 learner core + 1 sampler: none left
    assert not on and "2 core(s)" in why and "learner.drift_process" in why
    assert drift_process(load_config(None, ["runtime.sampler_cpus=0.5"]))[0] is False  # half a core is not one
    assert drift_process(load_config(None, ["learner.drift_process=false"])) == (False, "")
    assert drift_process(load_config(None, ["runtime.ray_address=auto"])) == (True, "")  # the cluster's cores
    assert drift_process(load_config(None, ["runtime.num_samplers=elastic"])) == (True, "")  # elastic: samplers elsewhere
    assert drift_process(load_config("grpo_baseline", [])) == (True, "")  # AdamW has no drift process: nothing to say
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert drift_process(load_config(None, [])) == (True, "")
    assert drift_process(load_config(None, ["runtime.num_samplers=2"]))[0] is False
    # a restore starts the learner after the driver was moved off the learner's core: the run's cores count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert drift_process(load_config(None, []), cores={0, 1, 2}) == (True, "")


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_processes_are_placed_and_given_back():
    sleep = "import time; time.sleep(60)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleep!r}]); time.sleep(60)"
    learner = subprocess.Popen([sys.executable, "-c", child])
    other = subprocess.Popen([sys.executable, "-c", sleep])
    helper = None
    try:
        deadline = time.monotonic() + 20
        while not descendants(learner.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        helper = descendants(learner.pid)[0]
        assert {learner.pid, other.pid, helper} <= set(descendants(os.getpid()))
        placement = CorePlacement(load_config(None, []))
        mine, rest = placement.cores
        assert mine == {CORES[-1]} and rest == set(CORES[:-1])
        placement.place(learner.pid)
        assert all(os.sched_getaffinity(int(t)) == mine for t in os.listdir(f"/proc/{learner.pid}/task"))
        assert os.sched_getaffinity(helper) == rest  # the learner's own helper process is not the learner
        assert os.sched_getaffinity(other.pid) == rest and os.sched_getaffinity(0) == rest
        assert "runs on core(s)" in str(placement)
        placement.release()
        for pid in (learner.pid, helper, other.pid, 0):
            assert os.sched_getaffinity(pid) == set(CORES)
    finally:
        if helper:
            os.kill(helper, 9)
        for p in (learner, other):
            p.kill()
            p.wait()


def test_half_precision_the_cpu_would_emulate_is_said_once_per_role():
    both = load_config(None, ["learner.bf16=true", "sampler.dtype=bfloat16"])
    line = half_precision_note(both, native=False)
    assert "learner.bf16=true and the hf sampler serving bfloat16" in line and "AVX-512 BF16" in line
    assert half_precision_note(both, native=True) == ""  # the CPU has the instructions
    assert "hf sampler serving bfloat16" in half_precision_note(load_config(None, ["model.dtype=bfloat16"]), native=False)
    assert half_precision_note(load_config(None, []), native=False) == ""  # fp32: nothing to say
    assert half_precision_note(load_config(None, ["learner.bf16=true", "learner.device=cuda"]), native=False) == ""
    assert half_precision_note(load_config(None, ["learner.bf16=true", "runtime.ray_address=auto"]), native=False) == ""
    assert half_precision_note(load_config(None, ["sampler.dtype=bfloat16", "sampler.backend=vllm"]), native=False) == ""
