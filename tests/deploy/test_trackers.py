"""Experiment trackers (deploy/trackers.py): TensorBoard event files and an offline W&B run hold every
numeric metrics.jsonl row, held-out rows that arrive after later steps included."""

from __future__ import annotations

import glob
import struct

import pytest

from threepo.deploy.config import ConfigError, load_config
from threepo.deploy.trackers import make_trackers

ROWS = [{"step": 1, "reward_mean": 0.5, "sync_reason": "kl", "sync_event": True},
        {"step": 2, "reward_mean": 0.75, "loss": float("nan")},
        {"step": 1, "heldout_pass1": 0.25, "heldout_n": 8}]  # step 1's evaluation, finished after step 2


def _log(names, run_dir):
    trackers = make_trackers(names, str(run_dir), project="threepo-test", mode="offline", config={"runtime": {"steps": 2}})
    for row in ROWS:
        for tracker in trackers:
            tracker.log(row)
    for tracker in trackers:
        tracker.close()


def test_tensorboard_holds_every_numeric_row_at_its_learner_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(("tensorboard",), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["heldout_n", "heldout_pass1", "reward_mean"]  # no str, bool, NaN
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("heldout_pass1")] == [(1, 0.25)]


def _wandb_records(path: str):
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log framing —
    32 KiB blocks of (crc32c, length, type) chunks, a record FULL (1) or FIRST/MIDDLE/LAST (2/3/4)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, block = open(path, "rb").read(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_an_offline_wandb_run_holds_every_numeric_row_against_the_learner_step(tmp_path):
    pytest.importorskip("wandb")
    _log(("wandb",), tmp_path)
    (log,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = [{key: float(item.value_json) for item in r.history.item
                for key in [item.key or "/".join(item.nested_key)] if not key.startswith("_")}
               for r in _wandb_records(log) if r.WhichOneof("record_type") == "history"]
    assert history == [{"reward_mean": 0.5, "learner_step": 1.0}, {"reward_mean": 0.75, "learner_step": 2.0},
                       {"heldout_pass1": 0.25, "heldout_n": 8.0, "learner_step": 1.0}]


def test_a_tracker_that_is_not_installed_is_refused_at_start(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"runtime.trackers: wandb is not installed \(pip install 'threepo\[tracking\]'\)"):
        load_config(None, ['runtime.trackers=["wandb"]'])
    with pytest.raises(ConfigError, match="runtime.trackers"):
        load_config(None, ['runtime.trackers=["mlflow"]'])
