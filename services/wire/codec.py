"""msgpack wire format for the messages of `services/wire/messages.py`, outside Ray.

Everything that leaves a process without Ray's own serialisation goes through here: rollout logs,
the rollout buffer inside checkpoints, remote verifiers. A record is an envelope
`{"schema": SCHEMA_VERSION, "type": <class name>, "fields": {...}}`; decoding refuses any other
schema version or type, saying which it got and what it expected, instead of guessing.

Values round-trip exactly: nested message dataclasses and enums carry their class name, tuples stay
tuples and lists stay lists, numpy arrays travel as (dtype, shape, raw bytes) and numpy scalars as
(dtype, raw bytes), floats as float64 (so NaN rewards survive). Only classes defined in
`services/wire/messages.py` are encoded or decoded: there is no registry to extend.

`RolloutLog` is an append-only file of length-prefixed records with a CRC32 per record. A torn last
record (the writer died mid-append) is reported and skipped by the reader, and cut off when the log is
reopened for appending; a bad record anywhere else is corruption and raises. `LogWriter` appends
to one from a thread of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np

from threepo.services.wire import messages
from threepo.services.wire.messages import SCHEMA_VERSION

log = logging.getLogger(__name__)

# msgpack extension codes; stable across schema versions (they describe values, not messages).
_EXT_DATACLASS, _EXT_ENUM, _EXT_NDARRAY, _EXT_NPSCALAR, _EXT_TUPLE = 1, 2, 3, 4, 5
_HEADER = struct.Struct(">II")  # payload length, CRC32 of the payload


@functools.cache
def _message_types() -> dict[str, type]:
    """Dataclasses and enums defined in services/wire/messages.py, by class name."""
    found = {}
    for name, obj in vars(messages).items():
        if isinstance(obj, type) and obj.__module__ == messages.__name__:
            if dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum):
                found[name] = obj
    return found


def _lookup(name: str, kind: str) -> type:
    types = _message_types()
    cls = types.get(name)
    wanted = (lambda c: dataclasses.is_dataclass(c)) if kind == "message" else (lambda c: issubclass(c, enum.Enum))
    if cls is None or not wanted(cls):
        known = sorted(n for n, c in types.items() if wanted(c))
        raise ValueError(f"codec: unknown {kind} type {name!r}; expected one of {known}")
    return cls


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def _default(obj: Any) -> msgpack.ExtType:
    # strict_types sends every tuple, subclass (enum) and numpy value here, so each keeps its type.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _lookup(type(obj).__name__, "message")  # refuse at the writer what no reader could decode
        return msgpack.ExtType(_EXT_DATACLASS, _pack([type(obj).__name__, _fields(obj)]))
    if isinstance(obj, enum.Enum):
        _lookup(type(obj).__name__, "enum")
        return msgpack.ExtType(_EXT_ENUM, _pack([type(obj).__name__, obj.value]))
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"codec: numpy arrays of dtype object cannot be encoded (shape {obj.shape})")
        body = [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
        return msgpack.ExtType(_EXT_NDARRAY, _pack(body))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_EXT_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    # Anything else, including non-enum subclasses of builtins, which strict_types also routes here.
    raise TypeError(f"codec: cannot encode a value of type {type(obj).__name__}: {obj!r:.80}")


def _ext_hook(code: int, data: bytes) -> Any:
    body = _unpack(data)
    if code == _EXT_DATACLASS:
        name, fields = body
        return _build(_lookup(name, "message"), fields)
    if code == _EXT_ENUM:
        name, value = body
        return _lookup(name, "enum")(value)
    if code == _EXT_NDARRAY:
        dtype, shape, raw = body
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _EXT_NPSCALAR:
        dtype, raw = body
        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
    if code == _EXT_TUPLE:
        return tuple(body)
    raise ValueError(f"codec: unknown msgpack extension code {code}; expected 1..5")


def _fields(obj: Any) -> dict[str, Any]:
    # Not dataclasses.asdict: that would flatten nested messages into dicts and lose their types.
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _build(cls: type, fields: dict[str, Any]) -> Any:
    expected = {f.name for f in dataclasses.fields(cls) if f.init}
    required = {f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(fields) - expected, required - set(fields)
    if unknown or missing:
        raise ValueError(f"codec: {cls.__name__} record does not match schema version {SCHEMA_VERSION}: "
                         f"unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
    return cls(**fields)


def encode(msg: Any) -> bytes:
    """One message (an instance of a dataclass in services/wire/messages.py) -> msgpack bytes."""
    if not dataclasses.is_dataclass(msg) or isinstance(msg, type):
        raise TypeError(f"codec.encode: expected a message dataclass, got {type(msg).__name__}")
    _lookup(type(msg).__name__, "message")
    envelope = {"schema": SCHEMA_VERSION, "type": type(msg).__name__, "fields": _fields(msg)}
    return _pack(envelope)


def decode(data: bytes) -> Any:
    """msgpack bytes from `encode` -> the message. Raises ValueError on a schema or type mismatch."""
    head = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=lambda code, raw: None)
    if not isinstance(head, dict) or set(head) != {"schema", "type", "fields"}:
        raise ValueError("codec.decode: not a threepo record (expected a map with keys schema, type, fields)")
    if head["schema"] != SCHEMA_VERSION:
        raise ValueError(f"codec.decode: {head['type']} record has schema version {head['schema']!r}, "
                         f"this build reads schema version {SCHEMA_VERSION}")
    cls = _lookup(str(head["type"]), "message")
    return _build(cls, _unpack(data)["fields"])


class RolloutLog:
    """Append-only file of length-prefixed, CRC-checked msgpack records (one message each).

    Opening for append cuts off a torn last record left by a writer that died mid-append, so new
    records never follow garbage. Records are flushed to the OS on every append; pass `fsync=True`
    to also force them to disk (slower; a checkpoint fsyncs what it copies anyway).
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            good_end = _scan(self.path)
            if good_end < self.path.stat().st_size:
                log.warning("RolloutLog %s: cutting a torn last record at byte %d (file had %d bytes)",
                            self.path, good_end, self.path.stat().st_size)
                os.truncate(self.path, good_end)
        self._file = open(self.path, "ab")

    def append(self, msg: Any) -> None:
        payload = encode(msg)
        self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def size(self) -> int:
        """Bytes written so far (every append is flushed): what a checkpoint records, so a resumed
        run can cut the log back to exactly the groups consumed before it."""
        return self._file.tell()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RolloutLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read(path: str | os.PathLike) -> Iterator[Any]:
        """Yield every complete record of the log at `path`, streaming; a torn last record is
        logged and skipped."""
        with open(path, "rb") as f:
            for _, payload in _records(f, Path(path)):
                yield decode(payload)


class LogWriter:
    """A `RolloutLog` written by a thread of its own (the learner's): a step only queues its consumed
    groups (their rows still point into the step's arrays); encoding them with those arrays (one
    `ConsumedStep` record per step) and appending happen behind the next step. `size()` waits for
    everything queued (a checkpoint records it); a write that failed is raised by the next `put` or
    `size`."""

    def __init__(self, log: RolloutLog) -> None:
        self.log, self.queue, self.error = log, queue.Queue(), None
        threading.Thread(target=self._run, name="rollout-log", daemon=True).start()

    def put(self, groups, batches, scores, step: int) -> None:
        self._raise()
        self.queue.put((groups, batches, scores, step))

    def size(self) -> int:
        self.queue.join()
        self._raise()
        return self.log.size()

    def close(self) -> None:
        self.size()
        self.log.close()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout log {self.log.path}: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            groups, batches, scores, step = self.queue.get()
            try:
                if self.error is None:  # arrays as they came: no per-completion objects
                    self.log.append(messages.ConsumedStep(step, tuple(groups), tuple(batches), tuple(scores)))
            except Exception as err:  # noqa: BLE001 (kept, raised in the caller's thread)
                self.error = err
            finally:
                self.queue.task_done()


def _records(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    """(end offset, payload) of each complete record in `f`; stops with a warning at a torn tail."""
    size = os.fstat(f.fileno()).st_size
    offset, count = 0, 0
    while offset < size:
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size:
            _report_torn(path, offset, count, "header cut short")
            return
        length, crc = _HEADER.unpack(header)
        payload = f.read(length)
        end = offset + _HEADER.size + length
        if len(payload) < length:
            _report_torn(path, offset, count, f"payload of {length} bytes cut short")
            return
        if zlib.crc32(payload) != crc:
            if end == size:
                _report_torn(path, offset, count, "CRC mismatch in the last record")
                return
            raise ValueError(f"RolloutLog {path}: record {count} at byte {offset} fails its CRC check "
                             "and is not the last record: the file is corrupt")
        yield end, payload
        offset, count = end, count + 1


def _report_torn(path: Path, offset: int, count: int, why: str) -> None:
    log.warning("RolloutLog %s: torn last record at byte %d (%s); keeping the %d complete records before it",
                path, offset, why, count)


def _scan(path: Path) -> int:
    """End offset of the last complete record of the log at `path`."""
    end = 0
    with open(path, "rb") as f:
        for end, _ in _records(f, path):
            pass
    return end
