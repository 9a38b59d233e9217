import asyncio
import json
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from threepo.services.model.tokenizer import CHARSET
from threepo.services.tasks.datasets import load_dataset
from threepo.services.tasks.synthetic import FAMILIES, SPLITS, TaskConfig, expected_completion, generate_items, split_of
from threepo.services.verifiers.base import load_verifier
from threepo.services.wire.messages import VerifyRequest, VerifyStatus

LEVELS = [("arith", 1), ("arith", 2), ("arith", 3), ("countdown", 1), ("countdown", 2)]


def test_charset_is_the_tokenizer_alphabet():
    assert len(set(CHARSET)) == len(CHARSET)  # one token id per character
    for needed in " 0123456789+-*=()\\{}QA:":
        assert needed in CHARSET


@pytest.mark.parametrize("family,difficulty", LEVELS)
def test_generation_is_deterministic_and_seeded(family, difficulty):
    a = generate_items(family, "train", 50, seed=1, difficulty=difficulty)
    assert a == generate_items(family, "train", 50, seed=1, difficulty=difficulty)
    assert a[:10] == generate_items(family, "train", 10, seed=1, difficulty=difficulty)
    b = generate_items(family, "train", 50, seed=2, difficulty=difficulty)
    assert [x.prompt for x in a] != [x.prompt for x in b]
    assert len({x.prompt for x in a}) == 50 and len({x.uid for x in a}) == 50
    assert a[3].uid == f"{family}/d{difficulty}/train/s1/3"


@pytest.mark.parametrize("family,difficulty", LEVELS)
def test_every_character_is_in_charset(family, difficulty):
    allowed = set(CHARSET)
    for split in SPLITS:
        for item in generate_items(family, split, 100, seed=0, difficulty=difficulty):
            text = item.prompt + item.answer + item.solution + expected_completion(item)
            assert set(text) <= allowed, set(text) - allowed


@pytest.mark.parametrize("family,difficulty", LEVELS)
def test_train_and_heldout_are_disjoint_across_seeds(family, difficulty):
    def keys(items):  # order-free: 58+23 and 23+58 are one problem
        if family == "countdown":
            return {(tuple(sorted(i.numbers)), i.answer) for i in items}
        return {_arith_key(i.prompt) for i in items}

    train = set().union(*(keys(generate_items(family, "train", 300, seed=s,
                                              difficulty=difficulty)) for s in range(3)))
    heldout = set().union(*(keys(generate_items(family, "heldout", 100, seed=s,
                                                difficulty=difficulty)) for s in range(3)))
    assert train and heldout and not train & heldout


def _arith_key(prompt):
    a, op, b = re.match(r"Q: (\d+)([-+*])(\d+)= A: $", prompt).groups()
    return (op, *sorted((int(a), int(b)))) if op in "+*" else (op, int(a), int(b))


def test_split_is_about_one_tenth_heldout_and_seed_free():
    buckets = Counter(split_of(f"arith:{a}+{b}") for a in range(10, 100) for b in range(a, 100))
    assert 0.07 < buckets["heldout"] / sum(buckets.values()) < 0.13


def test_difficulty_changes_the_distribution():
    def ops(difficulty):
        items = generate_items("arith", "train", 300, seed=0, difficulty=difficulty)
        return Counter(_arith_key(i.prompt)[0] for i in items), items

    ops1, items1 = ops(1)
    ops2, _ = ops(2)
    ops3, items3 = ops(3)
    assert set(ops1) == {"+", "-"} and set(ops2) == {"+", "-", "*"} and set(ops3) == {"*"}
    assert all(int(i.answer) >= 0 for i in items1)
    assert min(len(i.answer) for i in items3) >= 3  # 10*10 = 100 at least
    sizes = {d: {len(i.numbers) for i in generate_items("countdown", "train", 50, difficulty=d)}
             for d in (1, 2)}
    assert sizes == {1: {3}, 2: {4}}


def test_reference_solutions_show_work():
    # 23*58 = 23*50 + 23*8: the worked steps split the second factor into tens and units.
    item = next(i for i in generate_items("arith", "train", 200, difficulty=3)
                if i.prompt == "Q: 49*67= A: ")
    assert item.solution == "49*67=49*60+49*7=2940+343=3283 \\boxed{3283}"
    assert expected_completion(item) == "\\boxed{3283}"
    countdown = generate_items("countdown", "train", 1, difficulty=1)[0]
    assert expected_completion(countdown).startswith("\\boxed{")
    assert expected_completion(countdown) != f"\\boxed{{{countdown.answer}}}"


@pytest.mark.parametrize("family,difficulty", LEVELS)
def test_every_generated_answer_verifies(family, difficulty):
    items = (generate_items(family, "train", 40, seed=3, difficulty=difficulty)
             + generate_items(family, "heldout", 20, seed=3, difficulty=difficulty))
    verifier = load_verifier(items[0].verifier)

    async def score():
        return [await verifier.verify(VerifyRequest(i, expected_completion(i))) for i in items]

    results = asyncio.run(score())
    assert [r.status for r in results] == [VerifyStatus.OK] * len(items), results
    # The worked solution itself ends in the boxed answer, so it scores too.
    solution = asyncio.run(verifier.verify(VerifyRequest(items[0], items[0].solution)))
    assert solution.status is VerifyStatus.OK


def test_config_validation_names_the_field():
    assert TaskConfig().family in FAMILIES
    with pytest.raises(ValueError, match="family"):
        TaskConfig(family="chess")
    with pytest.raises(ValueError, match="difficulty"):
        TaskConfig(family="countdown", difficulty=3)
    with pytest.raises(ValueError, match="seed"):
        TaskConfig(seed=-1)
    with pytest.raises(ValueError, match="split"):
        generate_items("arith", "test", 3)
    with pytest.raises(ValueError, match="only .* distinct"):
        generate_items("arith", "heldout", 2000, difficulty=3)


# --- dataset loader -------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_loads_with_optional_fields(tmp_path):
    path = _write_jsonl(tmp_path / "gsm.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4"},
        "",
        {"prompt": "p", "answer": 7, "solution": "3+4=7", "tests": ["assert f() == 7"],
         "verifier": "code_tests", "id": "q7"},
        {"prompt": "reach 6", "answer": "6", "verifier": "countdown", "numbers": [2, 3]},
    ])
    items = load_dataset(path)
    assert [i.uid for i in items] == ["gsm.jsonl:1", "q7", "gsm.jsonl:4"]
    assert items[0].verifier == "math" and items[0].solution == "" and items[0].tests == ()
    assert items[1].answer == "7" and items[1].tests == ("assert f() == 7",)
    assert items[1].solution == "3+4=7" and items[1].verifier == "code_tests"
    assert items[2].numbers == (2, 3)


@pytest.mark.parametrize("bad,line,message", [
    ('{"prompt": "p", "answer": "1"', 2, "invalid JSON"),
    ({"prompt": "", "answer": "1"}, 2, "'prompt': expected a non-empty string"),
    ({"prompt": "p"}, 2, "'answer': expected a non-empty string"),
    ({"prompt": "p", "answer": "1", "tests": "assert x"}, 2, "'tests': expected a list"),
    ({"prompt": "p", "answer": "1", "question": "x"}, 2, "unknown columns"),
    ({"prompt": "p", "answer": "1", "id": "a"}, 2, "repeats line 1"),
    ([1, 2], 2, "expected a JSON object"),
])
def test_jsonl_error_names_file_and_line(tmp_path, bad, line, message):
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "q", "answer": "1", "id": "a"}, bad])
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(path)
    assert f"data.jsonl, line {line}" in str(info.value)


def test_parquet_loads_and_errors_name_row(tmp_path):
    good = tmp_path / "math.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "\\frac{1}{2}"],
                             "solution": [None, "half"], "tests": [["t1"], []]}), good)
    items = load_dataset(good)
    assert [(i.uid, i.answer, i.solution, i.tests) for i in items] == [
        ("math.parquet:0", "1", "", ("t1",)), ("math.parquet:1", "\\frac{1}{2}", "half", ())]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": ["1", "2", "3"]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet, row 2: column 'prompt'"):
        load_dataset(bad)
    extra = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"], "level": ["5"]}), extra)
    with pytest.raises(ValueError, match="row 0: unknown columns"):
        load_dataset(extra)
    assert len(load_dataset(extra, ignore_columns=("level",))) == 1
    with pytest.raises(ValueError, match="expected a .jsonl, .jsonl.gz or .parquet"):
        load_dataset(tmp_path / "data.csv")
