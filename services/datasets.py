"""Load task datasets (GSM8K/MATH style) from JSONL or Parquet files into `TaskItem`s.

Columns: `prompt` and `answer` (required, non-empty strings; an integer answer is taken as its
decimal text), optional `solution` (reference text for LamPO's ROUGE-L), `tests` (list of
strings, for code tasks), `verifier` (default "math"; a built-in or installed verifier's name),
`numbers` (list of ints, countdown) and `id` (string or int; default `<file name>:<line>`). A bad row raises `UserInputError` naming the
file, the line (JSONL, 1-based) or row index (Parquet, 0-based) and what was expected; so do a
missing file, a JSONL line that is not UTF-8 and a file without rows. Nothing is dropped silently:
an unknown column is an error unless named in `ignore_columns`, and so is a repeated id. Blank
JSONL lines carry no row and are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from threepo.services.errors import MissingPathError, UserInputError
from threepo.services.messages import TaskItem
from threepo.services.verifiers.base import available_verifiers

COLUMNS = ("prompt", "answer", "solution", "tests", "verifier", "numbers", "id")


def load_dataset(path: str | Path, *, ignore_columns: tuple[str, ...] = ()) -> list[TaskItem]:
    """All rows of a `.jsonl` or `.parquet` file as TaskItems, in file order."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise UserInputError(f"{path}: expected a .jsonl or .parquet file, got suffix {path.suffix!r}")
    if not path.is_file():
        raise MissingPathError(f"{path}: no such file (expected a .jsonl or .parquet dataset)")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    if not rows:
        raise UserInputError(f"{path}: no rows; expected at least one row with `prompt` and `answer`")
    items: list[TaskItem] = []
    where_of_uid: dict[str, str] = {}
    verifiers = tuple(available_verifiers())
    for where, row in rows:
        item = _to_item(path, where, row, ignore_columns, verifiers)
        if item.uid in where_of_uid:
            raise UserInputError(f"{path}, {where}: id {item.uid!r} repeats {where_of_uid[item.uid]}; "
                             "expected unique ids")
        where_of_uid[item.uid] = where
        items.append(item)
    return items


def _jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserInputError(f"{path}, line {number}: not UTF-8 (byte {raw[exc.start]:#04x} at "
                                     f"column {exc.start + 1}); expected UTF-8 JSON") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserInputError(f"{path}, line {number}: invalid JSON ({exc.msg} at column "
                                     f"{exc.colno}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise UserInputError(f"{path}, line {number}: expected a JSON object, "
                                     f"got {type(row).__name__}")
            rows.append((f"line {number}", row))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowInvalid as exc:
        raise UserInputError(f"{path}: not a readable Parquet file ({exc})") from None
    # Parquet nulls in an optional column mean "absent", as a missing key does in JSONL.
    return [(f"row {index}", {k: v for k, v in row.items() if v is not None})
            for index, row in enumerate(table.to_pylist())]


def _to_item(path: Path, where: str, row: dict, ignore_columns: tuple[str, ...],
             verifiers: tuple[str, ...]) -> TaskItem:
    def fail(column: str, expected: str, value: Any) -> UserInputError:
        return UserInputError(f"{path}, {where}: column {column!r}: expected {expected}, "
                          f"got {value!r}"[:300])

    unknown = sorted(set(row) - set(COLUMNS) - set(ignore_columns))
    if unknown:
        raise UserInputError(f"{path}, {where}: unknown columns {unknown}; expected only {COLUMNS} "
                         "(pass ignore_columns=... to drop others on purpose)")
    for column in ("prompt", "answer"):
        value = row.get(column)
        if column == "answer" and isinstance(value, int) and not isinstance(value, bool):
            row = {**row, "answer": str(value)}
        elif not isinstance(value, str) or not value.strip():
            raise fail(column, "a non-empty string", value)
    for column in ("solution", "verifier"):
        if column in row and not isinstance(row[column], str):
            raise fail(column, "a string", row[column])
    tests = row.get("tests", [])
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise fail("tests", "a list of strings", tests)
    numbers = row.get("numbers", [])
    if not isinstance(numbers, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in numbers):
        raise fail("numbers", "a list of integers", numbers)
    uid = row.get("id", f"{path.name}:{where.split()[-1]}")
    if isinstance(uid, bool) or not isinstance(uid, (str, int)) or str(uid) == "":
        raise fail("id", "a non-empty string or an integer", uid)
    verifier = row.get("verifier", "math")
    if verifier not in verifiers:
        raise fail("verifier", f"one of {list(verifiers)}", verifier)
    return TaskItem(uid=str(uid), prompt=row["prompt"], answer=row["answer"], verifier=verifier,
                    solution=row.get("solution", ""), tests=tuple(tests), numbers=tuple(numbers),
                    family=path.stem)
