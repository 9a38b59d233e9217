"""A version's (m, σ) staged as one fp32 safetensors file in shared memory, for engine workers in other
processes: the engine writes it once per version and sends its path; every worker maps it read-only,
so the workers of a node share one copy and none holds m or σ on its device (engines/vllm_engine.py
with tensor_parallel_size > 1, engines/sglang_engine.py always). Node-local: workers on another
node (multi-node tensor parallelism) cannot open it, and their call fails.

Importing this module imports only torch (safetensors when a version is staged).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping

import numpy as np
import torch


def staging_dir() -> str:
    """Where staged (m, σ) files go: shared memory where the machine has it, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def stage_version(mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None, directory: str,
                  stem: str) -> str:
    """(m, σ) as one fp32 safetensors file `<directory>/<stem>.safetensors` (tensors `m/<name>`,
    `s/<name>`), written whole before it is named; returns its path."""
    from safetensors.numpy import save_file

    tensors = {f"m/{n}": np.ascontiguousarray(a, dtype=np.float32) for n, a in mean.items()}
    tensors.update({f"s/{n}": np.ascontiguousarray(a, dtype=np.float32) for n, a in (sigma or {}).items()})
    path = os.path.join(directory, stem + ".safetensors")
    save_file(tensors, path + ".part")
    os.replace(path + ".part", path)
    return path


def remove_staged(path: str | None) -> None:
    """Delete a staged file (workers that mapped it keep their pages until they drop them)."""
    if path:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def mapped_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The fp32 tensors of a safetensors file as views of one private mapping of it: nothing is read
    until used, and processes mapping the same file share its pages (written pages would be copied,
    never written back; the worker only reads)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    flat = torch.from_file(path, shared=False, size=8 + header_len + max(
        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0), dtype=torch.uint8)
    data = flat[8 + header_len:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise ValueError(f"{path}: {name} is {meta['dtype']}, the staged (m, σ) are F32")
        start, end = meta["data_offsets"]
        out[name] = data[start:end].view(torch.float32).view(meta["shape"])
    return out
