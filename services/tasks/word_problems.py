"""Grade-school word problems in GSM8K's layout, made here (no dataset download): one- and two-step
arithmetic about people and things, each row `{"question": ..., "answer": "<worked steps>\\n#### N"}`
with GSM8K's `<<a+b=c>>` calculator annotations, so a file of them loads with `data.format=gsm8k`
exactly as GSM8K itself does. Plain questions: the prompt's template and instruction are the run's
(services/tasks/prompting.py). Deterministic in (n, seed); the questions are distinct.
"""

from __future__ import annotations

import json
import random

NAMES = ("Tom", "Ana", "Lea", "Sam", "Mia", "Ben", "Zoe", "Max", "Ivy", "Leo", "Ada", "Eli")
THINGS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards", "shells", "coins", "toys")


def _problem(rng: random.Random, difficulty: int) -> tuple[str, str, int]:
    """(question, worked steps, answer) of one problem of a random kind: difficulty 1 = one addition
    or subtraction of numbers up to 20; 2 = also products, equal shares and two steps, up to 40."""
    name, other, thing = rng.choice(NAMES), rng.choice(NAMES), rng.choice(THINGS)
    top = 20 if difficulty == 1 else 40
    a, b, c = rng.randint(2, top), rng.randint(2, top * 3 // 4), rng.randint(2, 9)
    kind = rng.randrange(2 if difficulty == 1 else 6)
    if kind == 0:
        return (f"{name} has {a} {thing}. {other} gives {name} {b} more. How many {thing} does {name} have now?",
                f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}", a + b)
    if kind == 1:
        a = a + b
        return (f"{name} had {a} {thing} and gave {b} of them to {other}. How many {thing} does {name} have left?",
                f"{a}-{b}=<<{a}-{b}={a - b}>>{a - b}", a - b)
    if kind == 2:
        return (f"A box holds {c} {thing}. How many {thing} are in {b} boxes?", f"{c}*{b}=<<{c}*{b}={c * b}>>{c * b}",
                c * b)
    if kind == 3:
        total = b * c
        return (f"{name} shares {total} {thing} equally among {c} friends. How many {thing} does each friend get?",
                f"{total}/{c}=<<{total}/{c}={b}>>{b}", b)
    if kind == 4:
        return (f"{name} reads {b} pages a day. How many pages does {name} read in {c} days?",
                f"{b}*{c}=<<{b}*{c}={b * c}>>{b * c}", b * c)
    bought = c * b
    a = rng.randint(1, bought - 1)
    return (f"{name} buys {c} packs of {b} {thing} and gives {a} of them to {other}. "
            f"How many {thing} does {name} keep?",
            f"{c}*{b}=<<{c}*{b}={bought}>>{bought}\n{bought}-{a}=<<{bought}-{a}={bought - a}>>{bought - a}",
            bought - a)


def gsm8k_rows(n: int, seed: int = 0, difficulty: int = 2) -> list[dict]:
    """`n` distinct problems of `difficulty` (1 or 2) in GSM8K's layout."""
    if difficulty not in (1, 2):
        raise ValueError(f"difficulty: expected 1 or 2, got {difficulty!r}")
    rng, rows, seen = random.Random(f"word-problems/{difficulty}/{seed}"), [], set()
    while len(rows) < n:
        question, steps, answer = _problem(rng, difficulty)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": f"{steps}\n#### {answer}"})
    return rows


def write_gsm8k(path: str, n: int, seed: int = 0, difficulty: int = 2) -> str:
    """A JSONL file of `gsm8k_rows(n, seed, difficulty)` at `path`."""
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in gsm8k_rows(n, seed, difficulty))
    return path
