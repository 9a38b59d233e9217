"""Atomic checkpoints: a crash mid-write leaves `latest` on the previous complete checkpoint and no
partial step directory; keep-N pruning; the pointer fallback; safetensors helpers round-trip numpy
and torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from threepo.services.checkpoint import (
    latest_checkpoint, load_tensors, read_meta, save_tensors,
    write_checkpoint,
)


def _files(step: int) -> dict:
    return {"state.bin": f"state {step}".encode(),
            "model/weights.txt": lambda path: path.write_text(f"weights {step}")}


def test_write_then_latest_reads_it_back(tmp_path):
    assert latest_checkpoint(tmp_path / "ckpt") is None
    path = write_checkpoint(tmp_path / "ckpt", 7, _files(7), {"policy_version": 3})
    assert path.name == "step-00000007"
    assert latest_checkpoint(tmp_path / "ckpt") == path
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000007\n"
    assert (path / "state.bin").read_bytes() == b"state 7"
    assert (path / "model" / "weights.txt").read_text() == "weights 7"
    assert read_meta(path) == {"policy_version": 3, "step": 7}


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    good = write_checkpoint(root, 1, _files(1), {})

    def dies(path):
        path.write_bytes(b"half a model")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(root, 2, {"a.bin": b"ok", "model.bin": dies}, {})
    assert latest_checkpoint(root) == good
    assert (root / "latest").read_text() == "step-00000001\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]


def test_a_killed_writer_leaves_only_an_ignored_tmp_dir(tmp_path):
    root = tmp_path / "ckpt"
    good = write_checkpoint(root, 1, _files(1), {})
    partial = root / ".tmp-2-deadbeef"  # what SIGKILL mid-write leaves behind
    partial.mkdir()
    (partial / "state.bin").write_bytes(b"partial")
    (root / "step-00000003").mkdir()  # a step dir without meta.json is not a checkpoint
    assert latest_checkpoint(root) == good
    write_checkpoint(root, 4, _files(4), {})
    assert not partial.exists()  # the next writer clears crashed writers' leftovers


def test_pointer_to_missing_dir_falls_back_to_newest_complete(tmp_path):
    root = tmp_path / "ckpt"
    write_checkpoint(root, 1, _files(1), {})
    newest = write_checkpoint(root, 2, _files(2), {})
    (root / "latest").write_text("step-00000009\n")
    assert latest_checkpoint(root) == newest
    (root / "latest").write_text("../../etc\n")
    assert latest_checkpoint(root) == newest


def test_pointer_wins_over_a_newer_dir_written_before_a_crash(tmp_path):
    root = tmp_path / "ckpt"
    pointed = write_checkpoint(root, 1, _files(1), {})
    write_checkpoint(root, 2, _files(2), {"run": "crashed"})
    (root / "latest").write_text("step-00000001\n")  # died between the rename and the pointer update
    assert latest_checkpoint(root) == pointed
    again = write_checkpoint(root, 2, _files(2), {"run": "resumed"})  # the resumed run reaches step 2
    assert read_meta(again)["run"] == "resumed" and latest_checkpoint(root) == again


def test_keep_prunes_oldest(tmp_path):
    root = tmp_path / "ckpt"
    for step in (0, 5, 10, 15, 20):
        write_checkpoint(root, step, _files(step), {}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000015", "step-00000020"]
    for step in (25, 30):
        write_checkpoint(root, step, _files(step), {}, keep=None)
    assert len(list(root.glob("step-*"))) == 4


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a relative path"):
        write_checkpoint(tmp_path, 1, {"../escape": b"x"}, {})
    with pytest.raises(ValueError, match="not 'meta.json'"):
        write_checkpoint(tmp_path, 1, {"meta.json": b"{}"}, {})
    with pytest.raises(TypeError, match=r"files\['a'\] must be bytes or a callable"):
        write_checkpoint(tmp_path, 1, {"a": "text"}, {})
    with pytest.raises(ValueError, match="keep must be >= 1"):
        write_checkpoint(tmp_path, 1, {}, {}, keep=0)
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_checkpoint(tmp_path, 1, {}, {"cursor": object()})
    assert latest_checkpoint(tmp_path) is None and list(tmp_path.iterdir()) == []


def test_tensors_round_trip_with_their_kind(tmp_path):
    tensors = {
        "mean": np.arange(12, dtype=np.float32).reshape(3, 4),
        "hess": np.ones((4, 3), np.float64).T,  # not contiguous
        "momentum": torch.randn(5, dtype=torch.bfloat16),
        "step": torch.tensor(7),
    }
    readonly = np.zeros(2, np.int64)
    readonly.flags.writeable = False
    tensors["counts"] = readonly
    save_tensors(tmp_path / "state.safetensors", tensors)
    loaded = load_tensors(tmp_path / "state.safetensors")
    assert sorted(loaded) == sorted(tensors)
    for name in ("mean", "hess", "counts"):
        assert isinstance(loaded[name], np.ndarray) and loaded[name].dtype == tensors[name].dtype
        np.testing.assert_array_equal(loaded[name], tensors[name])
    assert loaded["momentum"].dtype == torch.bfloat16 and torch.equal(loaded["momentum"], tensors["momentum"])
    assert torch.equal(loaded["step"], tensors["step"])
    with pytest.raises(TypeError, match="'x' must be a numpy array or torch tensor, got list"):
        save_tensors(tmp_path / "bad.safetensors", {"x": [1, 2]})


def test_save_tensors_as_a_checkpoint_file(tmp_path):
    state = {"mean": np.full(3, 0.5, np.float32)}
    path = write_checkpoint(tmp_path, 3, {"posterior.safetensors": lambda p: save_tensors(p, state)},
                            {"versions": [2, 3]})
    np.testing.assert_array_equal(load_tensors(latest_checkpoint(tmp_path) / "posterior.safetensors")["mean"],
                                  state["mean"])
    assert json.loads((path / "meta.json").read_text())["versions"] == [2, 3]


_SAVE_READ_ONLY = """
import sys, numpy as np, torch, safetensors.torch  # imported before the peak is reset
from threepo.services.checkpoint import save_tensors
def peak():  # the process's peak resident MiB so far (the arrays, all live, are the most it held)
    return next(int(l.split()[1]) >> 10 for l in open("/proc/self/status") if l.startswith("VmHWM"))
arrays = {f"v0/mean/{i}": np.ones(16 << 20, np.float32) for i in range(4)}  # 256 MB, as a published version
for a in arrays.values():
    a.flags.writeable = False  # as the posterior server holds them
before = peak()
save_tensors(sys.argv[1], arrays)
print(before, peak())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's peak from /proc")
def test_saving_read_only_arrays_does_not_copy_them(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SAVE_READ_ONLY, str(tmp_path / "p.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak = map(int, out.stdout.split())
    assert peak - before < 64, (before, peak)  # a copy of the arrays would add 256 MiB
    loaded = load_tensors(tmp_path / "p.safetensors")
    assert sorted(loaded) == [f"v0/mean/{i}" for i in range(4)] and all(float(a.min()) == 1.0 for a in loaded.values())
