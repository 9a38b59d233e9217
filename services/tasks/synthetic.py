"""Synthetic verifiable task families: mixed 2-digit arithmetic and countdown.

Items are generated deterministically from a seed. Split membership (train / held-out) is decided
by a stable hash of the problem itself, never by the seed, so a held-out problem cannot appear in
train for any seed or difficulty. Commutative problems (`23+58`, `58+23`) and countdown problems
that differ only in the order of their numbers share one hash key, hence one split.

Every item carries a short worked `solution` ending in the boxed answer (LamPO's ROUGE-L target),
and every character of prompts, answers and solutions lies in `CHARSET`, the alphabet of the
character-level tokenizer (`services/model/tokenizer.py`, which owns it).

Not here: file datasets (`services/tasks/datasets.py`) and the code family (`services/tasks/code_tasks.py`,
written separately; it plugs into `FAMILIES` below).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from threepo.services.tasks.code_tasks import generate_code
from threepo.services.wire.messages import TaskItem

SPLITS = ("train", "heldout")
# Part of the task definition (like a dataset's published split), not a run knob: changing it
# would move problems between train and held-out across runs.
HELDOUT_PER_MILLE = 100
# Consecutive draws that found no new item before generation gives up (pool exhausted).
_MAX_MISSES = 100_000


@dataclass(frozen=True)
class TaskConfig:
    """Which synthetic task a run trains and evaluates on."""

    family: str = "arith"
    """Task family, a key of `FAMILIES` ("arith", "countdown" or "code")."""
    difficulty: int = 2
    """arith: 1 = 1-2 digit + and -, 2 = mixed 2-digit + - *, 3 = 2-digit x 2-digit only;
    countdown: 1 = three numbers, 2 = four numbers; code: see services/tasks/code_tasks.py."""
    seed: int = 0
    """Seed of the item stream (splits do not depend on it); in a run, the run's `seed` unless set."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"TaskConfig.family: expected one of {sorted(FAMILIES)}, "
                             f"got {self.family!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TaskConfig.seed: expected an int >= 0, got {self.seed!r}")
        # Each generator owns its difficulty levels; a dry draw validates without a second table.
        FAMILIES[self.family](random.Random(0), self.difficulty)


def generate_items(family: str, split: str, n: int, *, seed: int = 0,
                   difficulty: int = 2) -> list[TaskItem]:
    """`n` distinct items of `family` in `split` ("train" or "heldout").

    Deterministic in (family, difficulty, split, seed); the first `n` items do not depend on how
    many are asked for. uids read `family/d<difficulty>/<split>/s<seed>/<index>`.
    """
    TaskConfig(family=family, difficulty=difficulty, seed=seed)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    generate = FAMILIES[family]
    rng = random.Random(f"{family}/{difficulty}/{split}/{seed}")
    items: list[TaskItem] = []
    seen: set[str] = set()
    misses = 0
    while len(items) < n:
        key, item = generate(rng, difficulty)
        if item.prompt in seen or split_of(key) != split:
            misses += 1
            if misses > _MAX_MISSES:
                raise ValueError(f"n: only {len(items)} distinct {split} items of {family!r} "
                                 f"difficulty {difficulty} were found, {n} were asked for")
            continue
        misses = 0
        seen.add(item.prompt)
        uid = f"{family}/d{difficulty}/{split}/s{seed}/{len(items)}"
        items.append(dataclasses.replace(item, uid=uid))
    return items


@functools.lru_cache(maxsize=None)
def max_new_tokens_for(family: str, difficulty: int) -> int:
    """The generation limit of a task tier (what `sampler.max_new_tokens = "auto"` resolves to): the
    longest reference completion over 2,000 train items (one token per character, `CHARSET`) plus
    EOS, plus a quarter for longer valid answers, rounded up to a multiple of 8, at least 16.
    arith: 16 at every level; countdown: 24, 32; code: 32, 48, 64."""
    items = generate_items(family, "train", 2000, seed=0, difficulty=difficulty)
    longest = max(len(expected_completion(item)) for item in items)
    return max(16, -(-(longest + 1 + -(-longest // 4)) // 8) * 8)


def split_of(key: str) -> str:
    """The split a problem belongs to, from a stable hash of its canonical key."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1000
    return "heldout" if bucket < HELDOUT_PER_MILLE else "train"


def expected_completion(item: TaskItem) -> str:
    """The SFT target for `item`: `\\boxed{answer}`, or for countdown the reference expression
    boxed (the final `\\boxed{...}` of its solution)."""
    if item.verifier == "code_output":  # the reference program, boxed
        return f"\\boxed{{{item.solution}}}"
    if item.verifier == "countdown":
        start = item.solution.rfind("\\boxed{")
        if start < 0:
            raise ValueError(f"item {item.uid!r}: countdown solution has no \\boxed{{...}} "
                             "expression to use as the expected completion")
        return item.solution[start:]
    return f"\\boxed{{{item.answer}}}"


# ---------------------------------------------------------------------------------------------
# Families. A generator takes (rng, difficulty), validates the difficulty, and returns the
# problem's canonical split key and a TaskItem without uid (generate_items stamps it).


def _arith_steps(a: int, op: str, b: int) -> str:
    """Worked steps by splitting `b` into tens and units: 23*58=23*50+23*8=1150+184=1334."""
    tens, units = b - b % 10, b % 10
    if b < 10 or units == 0:
        return f"{a}{op}{b}={_apply(a, op, b)}"
    if op == "*":
        return f"{a}*{b}={a}*{tens}+{a}*{units}={a * tens}+{a * units}={a * b}"
    partial = _apply(a, op, tens)
    return f"{a}{op}{b}={a}{op}{tens}{op}{units}={partial}{op}{units}={_apply(a, op, b)}"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def generate_arith(rng: random.Random, difficulty: int) -> tuple[str, TaskItem]:
    """`Q: 23+58= A: ` -> `\\boxed{81}`."""
    if difficulty == 1:
        op = rng.choice("+-")
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if op == "-" and a < b:  # level 1 stays non-negative
            a, b = b, a
    elif difficulty == 2:
        op = rng.choice("+-*")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    elif difficulty == 3:
        op = "*"
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    else:
        raise ValueError(f"difficulty: expected 1, 2 or 3 for family 'arith', got {difficulty!r}")
    answer = str(_apply(a, op, b))
    key = f"arith:{min(a, b)}{op}{max(a, b)}" if op in "+*" else f"arith:{a}{op}{b}"
    item = TaskItem(uid="", prompt=f"Q: {a}{op}{b}= A: ", answer=answer, verifier="math",
                    solution=f"{_arith_steps(a, op, b)} \\boxed{{{answer}}}",
                    family="arith", difficulty=difficulty)
    return key, item


_COUNTDOWN_SIZES = {1: (3, 10), 2: (4, 20)}  # difficulty -> (how many numbers, largest number)
_COUNTDOWN_MAX_TARGET = 999


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int, list[str]]:
    """Combine all `numbers` by a random binary tree of + - *; returns (text, value, steps)."""
    nodes = [(str(x), x, True) for x in numbers]
    steps: list[str] = []
    while len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        left, right = nodes[i], nodes[j]
        op = rng.choice("+-*")
        if op == "-" and left[1] < right[1]:  # keeps intermediate values non-negative
            left, right = right, left
        value = _apply(left[1], op, right[1])
        steps.append(f"{left[1]}{op}{right[1]}={value}")
        text = (left[0] if left[2] else f"({left[0]})") + op + (
            right[0] if right[2] else f"({right[0]})")
        nodes = [nd for k, nd in enumerate(nodes) if k not in (i, j)] + [(text, value, False)]
    return nodes[0][0], nodes[0][1], steps


def generate_countdown(rng: random.Random, difficulty: int) -> tuple[str, TaskItem]:
    """`Q: reach 56 with 3 4 8 A: ` -> `\\boxed{(3+4)*8}`; solvable by construction."""
    if difficulty not in _COUNTDOWN_SIZES:
        raise ValueError(f"difficulty: expected 1 or 2 for family 'countdown', got {difficulty!r}")
    count, largest = _COUNTDOWN_SIZES[difficulty]
    while True:
        numbers = [rng.randint(1, largest) for _ in range(count)]
        expression, target, steps = _random_expression(rng, numbers)
        if 1 <= target <= _COUNTDOWN_MAX_TARGET:
            break
    shown = " ".join(map(str, numbers))
    key = f"countdown:{sorted(numbers)}:{target}"
    item = TaskItem(uid="", prompt=f"Q: reach {target} with {shown} A: ", answer=str(target),
                    verifier="countdown", solution=f"{','.join(steps)} \\boxed{{{expression}}}",
                    numbers=tuple(numbers), family="countdown", difficulty=difficulty)
    return key, item


Generator = Callable[[random.Random, int], tuple[str, TaskItem]]

# name -> generator. To add a family (e.g. "code" from services/tasks/code_tasks.py, being written
# separately): write a Generator there that returns (canonical split key, TaskItem with uid="")
# and raises ValueError naming `difficulty` for a level it lacks, then add one line here.
FAMILIES: dict[str, Generator] = {
    "arith": generate_arith,
    "countdown": generate_countdown,
    "code": generate_code,
}
