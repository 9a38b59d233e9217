"""The code task family: write a one-line Python program whose printed output equals a target.

`Q: print 12 times 7 A: ` is answered by `\\boxed{print(12*7)}`. Every item is a
`TaskItem(verifier="code_output", answer=<expected stdout>, solution=<reference program>)`, and
the `code_output` verifier runs the program in the sandbox and compares its stdout with `answer`.

Levels (`difficulty`):
    1  two-number arithmetic:        print 12 times 7        -> print(12*7)
    2  integer operations on lists:  print the max of [3,9,2] -> print(max([3,9,2]))
    3  strings:                      print abc reversed      -> print('abc'[::-1])

Generated with `services.tasks.generate_items("code", split, n, seed=..., difficulty=...)`, which
decides the train / held-out split from the canonical key returned here. Prompts, answers and
solutions use only the tokenizer's alphabet (`CHARSET`, services/model/tokenizer.py); programs are one line,
since the alphabet has no newline. Answers are computed here directly, never by running code.
"""

from __future__ import annotations

import random
import string

from threepo.services.wire.messages import TaskItem


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 5)))


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(0, 20) for _ in range(rng.randint(3, 5))]


def _level1(rng: random.Random) -> tuple[str, str, str, str]:
    """(canonical key, prompt phrase, program, expected stdout) for two-number arithmetic."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    word, op = rng.choice([("times", "*"), ("plus", "+"), ("minus", "-")])
    value = a * b if op == "*" else a + b if op == "+" else a - b
    key = f"{min(a, b)}{op}{max(a, b)}" if op != "-" else f"{a}-{b}"
    return key, f"print {a} {word} {b}", f"print({a}{op}{b})", str(value)


def _level2(rng: random.Random) -> tuple[str, str, str, str]:
    kind = rng.choice(["mod", "floordiv", "power", "sum", "max", "min"])
    if kind in ("mod", "floordiv"):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        if kind == "mod":
            return f"{a}%{b}", f"print {a} mod {b}", f"print({a}%{b})", str(a % b)
        return (f"{a}//{b}", f"print {a} divided by {b} rounded down", f"print({a}//{b})",
                str(a // b))
    if kind == "power":
        a, b = rng.randint(2, 9), rng.randint(2, 4)
        return f"{a}**{b}", f"print {a} to the power {b}", f"print({a}**{b})", str(a ** b)
    if kind == "sum":
        a = rng.randint(1, 9)
        b = rng.randint(a + 1, 30)
        return (f"sum{a}:{b}", f"print the sum of {a} to {b}", f"print(sum(range({a},{b + 1})))",
                str(sum(range(a, b + 1))))
    xs = _numbers(rng)
    shown = "[" + ",".join(map(str, xs)) + "]"
    value = max(xs) if kind == "max" else min(xs)
    return f"{kind}{shown}", f"print the {kind} of {shown}", f"print({kind}({shown}))", str(value)


def _level3(rng: random.Random) -> tuple[str, str, str, str]:
    kind = rng.choice(["repeat", "reverse", "length", "vowels", "sorted"])
    w = _word(rng)
    if kind == "repeat":
        k = rng.randint(2, 4)
        return f"{w}*{k}", f"print {w} {k} times", f"print('{w}'*{k})", w * k
    if kind == "reverse":
        return f"rev:{w}", f"print {w} reversed", f"print('{w}'[::-1])", w[::-1]
    if kind == "length":
        return f"len:{w}", f"print the length of {w}", f"print(len('{w}'))", str(len(w))
    if kind == "vowels":
        count = sum(ch in "aeiou" for ch in w)
        return (f"vowels:{w}", f"print how many vowels are in {w}",
                f"print(sum(c in 'aeiou' for c in '{w}'))", str(count))
    xs = _numbers(rng)
    shown = "[" + ",".join(map(str, xs)) + "]"
    return f"sorted{shown}", f"print {shown} sorted", f"print(sorted({shown}))", str(sorted(xs))


_LEVELS = {1: _level1, 2: _level2, 3: _level3}


def generate_code(rng: random.Random, difficulty: int) -> tuple[str, TaskItem]:
    """A `services.tasks` generator: (canonical split key, TaskItem without uid)."""
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty: expected 1, 2 or 3 for family 'code', got {difficulty!r}")
    key, phrase, program, stdout = _LEVELS[difficulty](rng)
    item = TaskItem(uid="", prompt=f"Q: {phrase} A: ", answer=stdout, verifier="code_output",
                    solution=program, family="code", difficulty=difficulty)
    return f"code:{key}", item
