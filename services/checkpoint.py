"""Atomic checkpoint directories and safetensors helpers.

Layout under a checkpoint root (operations.md §4.2, the verl/SkyRL tracker pattern):

    root/step-00000012/       one complete checkpoint: the caller's files + meta.json
    root/latest               pointer file naming the newest complete checkpoint ("step-00000012")
    root/.tmp-<step>-<rand>/  a checkpoint being written (ignored by readers)

`write_checkpoint` writes everything into the temporary directory, fsyncs it, renames it to its
final name, and only then replaces `latest` (temporary file + `os.replace`). A crash at any point
therefore leaves `latest` naming a complete checkpoint. Readers trust the pointer when it names a
complete directory and otherwise fall back to the newest complete one (the pointer may lag by one
if the writer died between the rename and the pointer update).

What goes in a checkpoint is the caller's business (the learner and driver: posterior versions,
IVON state, model, data cursor, consumed ids, plan seeds, resolved config); this module
only makes writing it atomic. Not safe for two writers on one root at once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

POINTER = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_tree(top: Path) -> None:
    """fsync every file under `top`, then each directory, so the rename publishes durable data."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for dirpath, _, _ in os.walk(top, topdown=False):
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _target(tmp: Path, name: str) -> Path:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts or name == META:
        raise ValueError(f"write_checkpoint: file name {name!r} must be a relative path inside the "
                         f"checkpoint, without '..', and not {META!r} (that holds `meta`)")
    return tmp / rel


def _write_files(tmp: Path, files: Mapping[str, bytes | Callable[[Path], Any]]) -> None:
    for name, content in files.items():
        path = _target(tmp, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes | bytearray | memoryview):
            path.write_bytes(content)
        elif callable(content):
            content(path)  # e.g. save_pretrained(path) or save_tensors(path, ...)
        else:
            raise TypeError(f"write_checkpoint: files[{name!r}] must be bytes or a callable(path), "
                            f"got {type(content).__name__}")


def write_checkpoint(root: str | os.PathLike, step: int, files: Mapping[str, bytes | Callable[[Path], Any]],
                     meta: Mapping[str, Any], keep: int | None = 3) -> Path:
    """Write a checkpoint for `step` atomically and return its directory.

    `files` maps a relative path to its bytes or to a callable that writes that path (a file or a
    directory). `meta` (JSON-serialisable) is stored as meta.json with `step` added. After the
    pointer is updated, only the newest `keep` complete checkpoints are kept (None keeps all), and
    temporary directories left by crashed writers are removed. If anything raises, the temporary
    directory is removed and the exception propagates; `latest` is untouched.
    """
    tmp = begin_checkpoint(root, step, keep)
    return commit_checkpoint(root, step, tmp, files, meta, keep)


def begin_checkpoint(root: str | os.PathLike, step: int, keep: int | None = 3) -> Path:
    """A fresh temporary directory for the checkpoint of `step`, for several writers (each role
    writes its own files into it) before one `commit_checkpoint`."""
    if step < 0:
        raise ValueError(f"write_checkpoint: step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"write_checkpoint: keep must be >= 1 or None, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def commit_checkpoint(root: str | os.PathLike, step: int, tmp: Path, files: Mapping[str, bytes | Callable[[Path], Any]],
                      meta: Mapping[str, Any], keep: int | None = 3) -> Path:
    """Add `files` and meta.json to `tmp` (from `begin_checkpoint`), fsync, rename it to the step's
    directory and point `latest` at it; see `write_checkpoint`."""
    root, tmp = Path(root), Path(tmp)
    final = root / _step_name(step)
    try:
        _write_files(tmp, files)
        # meta.json last inside the directory: a step dir without it is not a checkpoint.
        (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():
            # Same step written again (a resumed run passing a checkpoint its crashed predecessor
            # wrote after the pointer's): the live run's state wins.
            stale = root / f".tmp-{step}-replaced-{secrets.token_hex(4)}"
            final.rename(stale)
            shutil.rmtree(stale)
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_pointer(root, final.name)
    _prune(root, keep, final)
    return final


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f".{POINTER}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / POINTER)
    _fsync_dir(root)


def _complete(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(root: Path, keep: int | None, current: Path) -> None:
    for path in root.iterdir():
        if path.name.startswith(".tmp-") or path.name.startswith(f".{POINTER}.tmp-"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if keep is None:
        return
    complete = [path for _, path in _complete(root)]
    for path in complete[:-keep]:
        if path != current:
            shutil.rmtree(path)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / POINTER
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and (root / name / META).is_file():
            return root / name
    complete = _complete(root)
    return complete[-1][1] if complete else None


def read_meta(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The meta dict of a checkpoint directory (with its `step`)."""
    return json.loads((Path(checkpoint) / META).read_text())


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, Any]) -> None:
    """Save a dict of numpy arrays and/or torch tensors to one safetensors file.

    Each entry's kind is recorded in the file's metadata, so `load_tensors` gives numpy back as
    numpy and torch as torch (bfloat16 included, which numpy cannot hold). Contiguous arrays and
    tensors are written from their own memory, read-only ones too (a posterior server's published
    versions: copying them doubled its memory while it saved)."""
    import warnings

    import torch
    from safetensors.torch import save_file

    out, kinds = {}, {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            with warnings.catch_warnings():  # torch warns that a read-only array is not writable: only read here
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                out[name] = torch.from_numpy(array)
            kinds[name] = "numpy"
        elif isinstance(value, torch.Tensor):
            out[name], kinds[name] = value.detach().to("cpu").contiguous(), "torch"
        else:
            raise TypeError(f"save_tensors: {name!r} must be a numpy array or torch tensor, "
                            f"got {type(value).__name__}")
    save_file(out, str(path), metadata={"threepo_kinds": json.dumps(kinds)})


def load_tensors(path: str | os.PathLike) -> dict[str, Any]:
    """Load a file written by `save_tensors` (CPU tensors; numpy entries as numpy arrays)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        kinds = json.loads((f.metadata() or {}).get("threepo_kinds", "{}"))
        loaded = {name: f.get_tensor(name) for name in f.keys()}
    return {name: t.numpy() if kinds.get(name) == "numpy" else t for name, t in loaded.items()}
