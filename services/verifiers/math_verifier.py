"""Math and countdown verifiers: format rules, then math-verify or exact evaluation.

Format rules, shared by both (algorithms.md §6.3: a policy once learnt to emit
` \\boxed{52}{}{}{` up to the length limit, which an answer-only reward scores as correct):
- a truncated completion (`finish_reason == "length"`) is `malformed`: a reward needs a
  well-formed, terminated completion;
- the answer is the last `\\boxed{...}`; none, unbalanced braces or an empty box is `malformed`,
  and so is what follows the box unless it is short text without digits, braces or LaTeX commands
  (sentence punctuation, `$`, "I hope this helps."): services/verifiers/math_answers.py.

Math (algorithms.md §6): the gold is parsed once per distinct answer (cached) as
`\\boxed{gold}` with `LatexExtractionConfig`; `verify(gold, pred)` is called GOLD FIRST (it is
not symmetric). math-verify's timeouts use SIGALRM, which works only in a process's main thread:
- `mode="inline"` checks in the calling thread and refuses any other than the main thread (a
  sync Ray actor or a CLI under `asyncio.run` runs coroutines there);
- `mode="process"` checks in spawned worker processes (each calls math-verify on its own main
  thread, with its timeouts) under an outer deadline; a worker past the deadline is killed and
  respawned, and the result is `timeout`.
math-verify runs with `raise_on_error=True`, so its own timeout surfaces as `timeout` and any
other exception as `infra_error` (reward NaN), never a silent 0.

Numbers are written one way before math-verify sees them (`normalize_number`: thousands
separators, a leading `+`, a trailing `.0`, `\\$`, `x = `; the list is in math_answers.py).
Departure: when the gold is a number, the boxed answer must be a number literal too
(`require_numeric_literal`): math-verify evaluates `\\boxed{23+58}` to 81, so restating the
question would otherwise earn full reward on arithmetic tasks.

Countdown: the boxed expression is parsed with `ast` (integers, + - * /, parentheses, unary
minus; anything else is `malformed`), the numbers it uses must be a sub-multiset of the given
ones (else `wrong`), and it is evaluated exactly with fractions. Its size is bounded by that
check, so it needs no timeout machinery.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import math
import multiprocessing
import queue
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from threepo.services.verifiers.math_answers import NO_BOX, final_boxed, last_number, normalize_number
from threepo.services.wire.messages import VerifyRequest, VerifyResult, VerifyStatus

MODES = ("inline", "process")


@dataclass(frozen=True)
class MathVerifierConfig:
    """Options of `MathVerifier` (passed as keywords through `load_verifier("math", ...)`)."""

    mode: str = "inline"
    """"inline": math-verify in the calling (main) thread; "process": in spawned workers."""
    workers: int = 1
    """Worker processes in process mode."""
    deadline_s: float = 20.0
    """Process mode: outer wall-clock limit of one check, after which the worker is killed."""
    parsing_timeout_s: int = 5
    """math-verify's own (SIGALRM, whole seconds) limit per parse."""
    verify_timeout_s: int = 5
    """math-verify's own (SIGALRM, whole seconds) limit per comparison."""
    require_numeric_literal: bool = True
    """When the gold is a number, accept only a number literal (no `23+58`) as the answer."""
    startup_timeout_s: float = 120.0
    """Process mode: how long a fresh worker may take to import math-verify."""
    max_trailing_chars: int = 64
    """Most characters of plain text (no digits, braces or LaTeX commands) allowed after the final
    box; more is `malformed`."""
    answer: str = "boxed"
    """Where the answer is: "boxed" (the final `\\boxed{}`, as above) or "last_number" (the final box
    when there is one, else the last number of a terminated completion: GSM8K's flexible extraction,
    for models that do not box their answers; a completion with neither is `malformed`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MathVerifierConfig.mode: expected one of {MODES}, got {self.mode!r}")
        if self.workers < 1:
            raise ValueError(f"MathVerifierConfig.workers: expected >= 1, got {self.workers}")
        if self.answer not in ("boxed", "last_number"):
            raise ValueError(f"MathVerifierConfig.answer: expected 'boxed' or 'last_number', got {self.answer!r}")
        if self.max_trailing_chars < 0:
            raise ValueError(f"MathVerifierConfig.max_trailing_chars: expected >= 0, "
                             f"got {self.max_trailing_chars}")
        for field, value in (("deadline_s", self.deadline_s),
                             ("startup_timeout_s", self.startup_timeout_s),
                             ("parsing_timeout_s", self.parsing_timeout_s),
                             ("verify_timeout_s", self.verify_timeout_s)):
            if not value > 0:
                raise ValueError(f"MathVerifierConfig.{field}: expected > 0, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Pure checks.

_COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/() ]+")


def _precheck(request: VerifyRequest, max_trailing_chars: int = 64, answer: str = "boxed") -> tuple[str | None, str]:
    """The answer (boxed, or with `answer="last_number"` the last number of an unboxed completion), or
    None and why the completion earns nothing regardless of its answer."""
    if request.finish_reason == "length":
        return None, "truncated: the completion hit the length limit without ending"
    if request.finish_reason != "stop":
        raise ValueError(f"VerifyRequest.finish_reason: expected 'stop' or 'length', "
                         f"got {request.finish_reason!r}")
    boxed, why = final_boxed(request.completion, max_trailing_chars)
    if boxed is None and why == NO_BOX and answer == "last_number":
        number = last_number(request.completion)
        return (number, "") if number is not None else (None, "no \\boxed{} answer and no number")
    return boxed, why


_INTEGER = re.compile(r"[+-]?\d+")


@functools.lru_cache(maxsize=1 << 16)
def _parse_gold(gold: str, parsing_timeout_s: int) -> list:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"\\boxed{{{gold}}}", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=parsing_timeout_s, raise_on_error=True)


def check_math(gold: str, answer: str, parsing_timeout_s: int = 5, verify_timeout_s: int = 5,
               require_numeric_literal: bool = True) -> tuple[VerifyStatus, str]:
    """Compare a boxed `answer` with `gold` by math-verify; must run on a main thread."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    gold_number, answer_number = normalize_number(gold), normalize_number(answer)
    gold, shown = gold_number or gold, answer
    answer = answer_number or answer  # 1,234 -> 1234 (math-verify reads 1\\,234 as 235)
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(answer):  # math-verify compares integers exactly
        same = int(gold) == int(answer)
        return (VerifyStatus.OK, "") if same else (VerifyStatus.WRONG, f"{shown[:40]!r} != {gold!r}")
    try:
        gold_parsed = _parse_gold(gold, parsing_timeout_s)
        if not gold_parsed:
            return VerifyStatus.INFRA_ERROR, f"gold answer {gold!r} does not parse"
        pred_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=parsing_timeout_s,
                            raise_on_error=True)
        if not pred_parsed:
            return VerifyStatus.MALFORMED, f"boxed answer {shown[:40]!r} does not parse"
        if require_numeric_literal and gold_number is not None and answer_number is None:
            return VerifyStatus.WRONG, f"answer {shown[:40]!r} is not a number literal"
        correct = verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout_s,
                         raise_on_error=True)
    except TimeoutException as exc:  # a BaseException: `except Exception` would miss it
        return VerifyStatus.TIMEOUT, f"math-verify: {str(exc)[:80]}"
    except Exception as exc:  # the checker failed, which says nothing about the completion
        return VerifyStatus.INFRA_ERROR, f"math-verify raised {type(exc).__name__}: {exc}"[:200]
    if not correct:
        return VerifyStatus.WRONG, f"{shown[:40]!r} != {gold!r}"
    return VerifyStatus.OK, ""


def _count_numbers(node: ast.AST, used: list[int]) -> str:
    """Collects the integer literals of `node` into `used`; returns why it is not allowed, or ""."""
    match node:
        case ast.Constant(value=int() as value) if not isinstance(value, bool):
            used.append(value)
            return ""
        case ast.BinOp(op=ast.Add() | ast.Sub() | ast.Mult() | ast.Div()):
            return _count_numbers(node.left, used) or _count_numbers(node.right, used)
        case ast.UnaryOp(op=ast.USub()):
            return _count_numbers(node.operand, used)
    return f"{type(node).__name__} is not allowed (only numbers, + - * / and parentheses)"


def _evaluate(node: ast.AST) -> Fraction:
    match node:
        case ast.Constant(value=value):
            return Fraction(value)
        case ast.UnaryOp(operand=operand):
            return -_evaluate(operand)
        case ast.BinOp(left=left, op=op, right=right):
            a, b = _evaluate(left), _evaluate(right)
            match op:
                case ast.Add():
                    return a + b
                case ast.Sub():
                    return a - b
                case ast.Mult():
                    return a * b
            return a / b
    raise AssertionError(f"unchecked node {type(node).__name__}")


def check_countdown(expression: str, numbers: tuple[int, ...], target: int,
                    max_expression_chars: int = 200) -> tuple[VerifyStatus, str]:
    """Whether `expression` reaches `target` using each of `numbers` at most once."""
    if len(expression) > max_expression_chars:
        return VerifyStatus.MALFORMED, f"expression longer than {max_expression_chars} chars"
    if not _COUNTDOWN_CHARS.fullmatch(expression):
        return VerifyStatus.MALFORMED, "only digits, + - * /, parentheses and spaces are allowed"
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        return VerifyStatus.MALFORMED, f"not an expression: {exc.msg}"
    used: list[int] = []
    why = _count_numbers(tree.body, used)
    if why:
        return VerifyStatus.MALFORMED, why
    extra = Counter(used) - Counter(numbers)
    if extra:
        return VerifyStatus.WRONG, f"uses {sorted(extra.elements())} beyond {list(numbers)}"
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return VerifyStatus.WRONG, "division by zero"
    if value != target:
        return VerifyStatus.WRONG, f"evaluates to {value}, not {target}"
    return VerifyStatus.OK, ""


def _result(status: VerifyStatus, details: str, started: float) -> VerifyResult:
    reward = {VerifyStatus.OK: 1.0, VerifyStatus.INFRA_ERROR: math.nan}.get(status, 0.0)
    return VerifyResult(status=status, reward=reward, details=details,
                        latency_s=time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# Process mode: a fixed set of spawned workers, each used by one check at a time.


def _worker_main(conn: Any) -> None:
    import math_verify  # noqa: F401  (import before reporting ready, so deadlines exclude it)

    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        conn.send(check_math(*args))


@dataclass(eq=False)  # identity: two workers are never equal
class _Worker:
    process: Any
    conn: Any
    ready: bool = False


class _WorkerPool:
    """Spawned math-verify workers; one past its deadline is killed and replaced."""

    def __init__(self, workers: int, deadline_s: float, startup_timeout_s: float) -> None:
        self._ctx = multiprocessing.get_context("spawn")  # never fork a CUDA/Ray process
        self._deadline_s = deadline_s
        self._startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._live: list[_Worker] = []
        self._lock = threading.Lock()
        for _ in range(workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child,), daemon=True)
        process.start()
        child.close()
        worker = _Worker(process, parent)
        with self._lock:
            self._live.append(worker)
        return worker

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        with self._lock:  # close() may have killed it already
            if worker in self._live:
                self._live.remove(worker)

    def call(self, args: tuple) -> tuple[VerifyStatus, str]:
        """Runs `check_math(*args)` in a worker; blocks, so call it from a thread."""
        worker = self._idle.get()
        conn = worker.conn
        try:
            if not worker.ready:  # the deadline starts once math-verify is imported
                if not conn.poll(self._startup_timeout_s) or conn.recv() != "ready":
                    raise EOFError(f"worker not ready within {self._startup_timeout_s}s")
                worker.ready = True
            conn.send(args)
            if conn.poll(self._deadline_s):
                result = conn.recv()
                self._idle.put(worker)
                return result
            outcome = (VerifyStatus.TIMEOUT,
                       f"check exceeded the {self._deadline_s}s deadline; worker respawned")
        except (EOFError, OSError) as exc:
            outcome = (VerifyStatus.INFRA_ERROR, f"verifier worker failed: {exc!r}")
        self._kill(worker)
        self._idle.put(self._spawn())
        return outcome

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for worker in live:
            self._kill(worker)


class MathVerifier:
    """`math`: boxed answer compared with the gold by math-verify (see the module docstring).

    Process mode spawns its workers in the constructor; a script that builds one must do so under
    `if __name__ == "__main__":` (spawn re-imports the main module). Call `close()` to stop them.
    """

    name = "math"

    def __init__(self, **options: Any) -> None:
        self.config = MathVerifierConfig(**options)
        cfg = self.config
        self._pool = (_WorkerPool(cfg.workers, cfg.deadline_s, cfg.startup_timeout_s)
                      if cfg.mode == "process" else None)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        started = time.perf_counter()
        cfg = self.config
        answer, why = _precheck(request, cfg.max_trailing_chars, cfg.answer)
        if answer is None:
            return _result(VerifyStatus.MALFORMED, why, started)
        args = (request.item.answer, answer, cfg.parsing_timeout_s, cfg.verify_timeout_s,
                cfg.require_numeric_literal)
        if self._pool is not None:
            status, details = await asyncio.to_thread(self._pool.call, args)
        elif threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "MathVerifier(mode='inline') must run on the main thread: math-verify's timeouts "
                "use SIGALRM. Use mode='process' in threaded or async actors.")
        else:
            status, details = check_math(*args)
        return _result(status, details, started)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


class CountdownVerifier:
    """`countdown`: the boxed expression must reach `item.answer` from `item.numbers`."""

    name = "countdown"

    def __init__(self, max_expression_chars: int = 200) -> None:
        if max_expression_chars < 1:
            raise ValueError(f"CountdownVerifier.max_expression_chars: expected >= 1, "
                             f"got {max_expression_chars}")
        self.max_expression_chars = max_expression_chars

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        started = time.perf_counter()
        item = request.item
        if not item.numbers:
            raise ValueError(f"TaskItem.numbers of {item.uid!r}: expected the given numbers "
                             "of a countdown item, got none")
        expression, why = _precheck(request)
        if expression is None:
            return _result(VerifyStatus.MALFORMED, why, started)
        status, details = check_countdown(expression, item.numbers, int(item.answer),
                                          self.max_expression_chars)
        return _result(status, details, started)

    def close(self) -> None:
        pass
