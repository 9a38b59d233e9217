"""Code verifiers: run the program a completion contains and score what it does.

`code_output` runs the program and compares its stdout with `TaskItem.answer` (here, in the
verifier's process: the program only writes its output); `code_tests` runs the program in the
sandbox and each statement of `TaskItem.tests` in a trusted process beside it, calling the program's
functions across with plain data only (services/verifiers/harness.py), and passes only when the
trusted side reports that every test ran and passed.

How the program is found in a completion (`extract_program`): among the fenced blocks (```python,
```py, ```python3 or unmarked; any case), the last one that defines the item's entry point when it
has one, else the last block; failing blocks, the content of the last `\\boxed{...}` (braces
balanced). When the item has a `code_prefix` (HumanEval's prompt: a signature and docstring) and the
program does not define the entry point itself, the program is the prefix followed by the completion
(a body-only completion, HumanEval's native form). No program is `malformed`. A program that
`compile()` rejects in the parent is `compile_error` (compiling parses but runs nothing). Statuses:

    code_output: exit 0 and stdout matches                   -> ok (reward 1)
                 exit 0, stdout differs                      -> wrong
                 non-zero exit (a signal included)           -> runtime_error
    code_tests:  the harness reports every test passed        -> ok (reward 1)
                 an AssertionError in a test (any message)   -> wrong
                 another exception (a result that is not
                 plain data included), the program's process
                 ending before the tests finished            -> runtime_error
    both:        output over the cap                         -> runtime_error
                 wall-clock deadline or CPU-time limit       -> timeout
                 the sandbox itself failed                   -> infra_error (reward NaN, never 0)

`score_run` holds that table once, so the remote verifier scores exactly like the local one.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from threepo.services.verifiers.harness import new_token, read_report, without_report
from threepo.services.verifiers.sandbox import OUTPUT_LIMIT_MESSAGE, LocalSandbox, RunResult, RunStatus, SandboxConfig
from threepo.services.verifiers.split_run import run_tests
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyResult, VerifyStatus

_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_BOXED = "\\boxed{"
_DETAIL_CHARS = 300


def _defines(program: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", program, re.MULTILINE) is not None


def extract_program(completion: str, entry_point: str = "") -> str | None:
    """The program in `completion`: the last fenced block defining `entry_point` (when given), else the
    last fenced block, else the last \\boxed{...}; None when there is none."""
    blocks = _FENCE.findall(completion)
    if blocks:
        defining = [b for b in blocks if entry_point and _defines(b, entry_point)]
        chosen = (defining or blocks)[-1]
        return chosen if chosen.strip() else None
    start = completion.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[i], 0)
        if depth == 0:
            body = completion[begin:i]
            return body if body.strip() else None
    return None  # unbalanced: the box never closes


def program_of(completion: str, item: TaskItem) -> str | None:
    """The program to run for `item`: the extracted program, joined to `item.code_prefix` when the item
    has one and the program does not define the entry point (a body-only completion); with a prefix,
    an unfenced completion is taken as a body as it stands (HumanEval's native form)."""
    program = extract_program(completion, item.entry_point)
    if not item.code_prefix:
        return program
    if program is None:
        program = completion if completion.strip() else None
    if program is None or (item.entry_point and _defines(program, item.entry_point)):
        return program
    return item.code_prefix + program


def syntax_error(code: str) -> str | None:
    """The parent-side compile check: a message for a program Python cannot compile, else None."""
    try:
        compile(code, "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        return f"{type(e).__name__}: {e}"
    return None


def normalize_output(text: str) -> str:
    """Trailing whitespace of each line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _tail(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:_DETAIL_CHARS] if lines else ""


def result(status: VerifyStatus, details: str, start: float) -> VerifyResult:
    reward = {VerifyStatus.OK: 1.0, VerifyStatus.INFRA_ERROR: math.nan}.get(status, 0.0)
    return VerifyResult(status, reward, details, time.monotonic() - start)


@dataclass(frozen=True)
class Prepared:
    """What to run: the program, what goes on its stdin, and what scores it: the expected stdout
    (code_output), or the tests and the trusted side's report token (code_tests)."""

    code: str
    stdin: str | None = None
    expected: str | None = None
    token: str | None = None
    tests: tuple[str, ...] = ()


def score_run(run: RunResult, expected_stdout: str | None, start: float, token: str | None = None) -> VerifyResult:
    """Score a finished sandbox run: by the harness's report when `token` is given (code_tests), else
    by exit status and stdout against `expected_stdout` (code_output)."""
    if run.status is RunStatus.SANDBOX_ERROR:
        return result(VerifyStatus.INFRA_ERROR, f"sandbox failed: {_tail(run.stderr)}", start)
    if run.status is RunStatus.TIMEOUT:
        return result(VerifyStatus.TIMEOUT, f"killed after {run.execution_time:.2f}s", start)
    if run.status is RunStatus.OUTPUT_LIMIT:
        return result(VerifyStatus.RUNTIME_ERROR, OUTPUT_LIMIT_MESSAGE, start)
    if token is not None:
        return _score_report(run, token, start)
    if run.return_code != 0:
        return result(VerifyStatus.RUNTIME_ERROR, f"exit {run.return_code}: {_tail(run.stderr)}", start)
    got, want = normalize_output(run.stdout), normalize_output(expected_stdout or "")
    if got == want:
        return result(VerifyStatus.OK, "output matches", start)
    return result(VerifyStatus.WRONG, f"expected {want[:80]!r}, got {got[:80]!r}", start)


def _score_report(run: RunResult, token: str, start: float) -> VerifyResult:
    report = read_report(run.stdout, token)
    if report is None:
        return result(VerifyStatus.RUNTIME_ERROR, f"exit {run.return_code} before the tests finished (no report "
                      f"from the test harness): {_tail(without_report(run.stderr, token))}", start)
    verdict, done, total, detail = report
    if verdict == "passed" and done == total and run.return_code == 0:
        return result(VerifyStatus.OK, f"all {total} tests passed", start)
    if verdict == "wrong":
        return result(VerifyStatus.WRONG, f"test {done + 1} of {total} failed: {detail}", start)
    if verdict == "error":
        return result(VerifyStatus.RUNTIME_ERROR, f"test {done + 1} of {total}: {detail}", start)
    if verdict == "timeout":
        return result(VerifyStatus.TIMEOUT, f"test {done + 1} of {total}: {detail}", start)
    return result(VerifyStatus.RUNTIME_ERROR, f"before the tests: {detail}", start)


def prepare(request: VerifyRequest, with_tests: bool) -> tuple[Prepared | None, VerifyResult | None]:
    """What to run (under the test harness when `with_tests`), or the result when there is nothing."""
    start = time.monotonic()
    item = request.item
    if with_tests and not item.tests:
        raise ValueError(f"TaskItem.tests of {item.uid!r}: expected at least one test "
                         "for the code_tests verifier, got none")
    program = program_of(request.completion, item)
    if program is None:
        return None, result(VerifyStatus.MALFORMED, "no ```python block or \\boxed{} program", start)
    error = syntax_error(program)
    if error is not None:
        return None, result(VerifyStatus.COMPILE_ERROR, error[:_DETAIL_CHARS], start)
    if not with_tests:
        return Prepared(program, expected=item.answer), None
    token = new_token()
    return Prepared(program, token=token, tests=tuple(item.tests)), None


class LocalCodeVerifier:
    """Runs programs in a `LocalSandbox`. `with_tests=False` is `code_output` (stdout must equal
    `TaskItem.answer`), `with_tests=True` is `code_tests` (the harness must report every test passed)."""

    def __init__(self, name: str, with_tests: bool, config: SandboxConfig | None = None,
                 **options) -> None:
        if config is not None and options:
            raise ValueError(f"{name}: pass either `config` or SandboxConfig fields, not both")
        self.name, self.with_tests = name, with_tests
        self.sandbox = LocalSandbox(config or SandboxConfig(**options))

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        start = time.monotonic()
        prepared, early = prepare(request, self.with_tests)
        if early is not None:
            return early
        if prepared.tests:
            run = await run_tests(self.sandbox, prepared.code, prepared.tests, prepared.token)
        else:
            run = await self.sandbox.run(prepared.code, stdin=prepared.stdin)
        return score_run(run, prepared.expected, start, prepared.token)

    def close(self) -> None:
        pass


def code_output(config: SandboxConfig | None = None, **options) -> LocalCodeVerifier:
    """The `code_output` verifier; `options` are `SandboxConfig` fields."""
    return LocalCodeVerifier("code_output", False, config, **options)


def code_tests(config: SandboxConfig | None = None, **options) -> LocalCodeVerifier:
    """The `code_tests` verifier; `options` are `SandboxConfig` fields."""
    return LocalCodeVerifier("code_tests", True, config, **options)
