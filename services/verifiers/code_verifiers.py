"""Code verifiers: run the program a completion contains and score what it does.

`code_output` runs the program and compares its stdout with `TaskItem.answer`; `code_tests` runs
the program followed by the assertions in `TaskItem.tests` and passes when it exits cleanly.

How the program is found in a completion (`extract_program`): the last fenced block marked
```python, ```py or unmarked; failing that, the content of the last `\\boxed{...}` (braces
balanced). No program is `malformed`. A program that `compile()` rejects in the parent is
`compile_error` (compiling parses but runs nothing). Statuses from a run:

    exit 0, stdout matches / tests pass           -> ok (reward 1)
    exit 0, stdout differs; AssertionError (tests) -> wrong
    any other non-zero exit, output over the cap   -> runtime_error
    wall-clock deadline or CPU-time limit          -> timeout
    the sandbox itself failed                      -> infra_error (reward NaN, never 0)

`score_run` holds that table once, so the remote verifier scores exactly like the local one.
"""

from __future__ import annotations

import math
import re
import time

from threepo.services.messages import VerifyRequest, VerifyResult, VerifyStatus
from threepo.services.verifiers.sandbox import (LocalSandbox, RunResult, RunStatus,
                                                SandboxConfig)

_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
_BOXED = "\\boxed{"
_DETAIL_CHARS = 300


def extract_program(completion: str) -> str | None:
    """The program in `completion` (last ```python block, else last \\boxed{...}), or None."""
    blocks = _FENCE.findall(completion)
    if blocks:
        return blocks[-1] if blocks[-1].strip() else None
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


def score_run(run: RunResult, expected_stdout: str | None, start: float) -> VerifyResult:
    """Score a finished sandbox run; `expected_stdout=None` means test mode (exit 0 passes)."""
    if run.status is RunStatus.SANDBOX_ERROR:
        return result(VerifyStatus.INFRA_ERROR, f"sandbox failed: {_tail(run.stderr)}", start)
    if run.status is RunStatus.TIMEOUT:
        return result(VerifyStatus.TIMEOUT, f"killed after {run.execution_time:.2f}s", start)
    if run.status is RunStatus.OUTPUT_LIMIT:
        return result(VerifyStatus.RUNTIME_ERROR, "output limit exceeded", start)
    if run.return_code != 0:
        last = _tail(run.stderr)
        if expected_stdout is None and last.startswith("AssertionError"):
            return result(VerifyStatus.WRONG, f"test failed: {last}", start)
        return result(VerifyStatus.RUNTIME_ERROR, f"exit {run.return_code}: {last}", start)
    if expected_stdout is None:
        return result(VerifyStatus.OK, "all tests passed", start)
    got, want = normalize_output(run.stdout), normalize_output(expected_stdout)
    if got == want:
        return result(VerifyStatus.OK, "output matches", start)
    return result(VerifyStatus.WRONG, f"expected {want[:80]!r}, got {got[:80]!r}", start)


def prepare(request: VerifyRequest, with_tests: bool) -> tuple[str | None, VerifyResult | None]:
    """The program to run (tests appended when `with_tests`), or the result when there is none."""
    start = time.monotonic()
    if with_tests and not request.item.tests:
        raise ValueError(f"TaskItem.tests of {request.item.uid!r}: expected at least one test "
                         "for the code_tests verifier, got none")
    program = extract_program(request.completion)
    if program is None:
        return None, result(VerifyStatus.MALFORMED, "no ```python block or \\boxed{} program", start)
    error = syntax_error(program)
    if error is not None:
        return None, result(VerifyStatus.COMPILE_ERROR, error[:_DETAIL_CHARS], start)
    if with_tests:
        program = program + "\n\n" + "\n".join(request.item.tests) + "\n"
    return program, None


class LocalCodeVerifier:
    """Runs programs in a `LocalSandbox`. `with_tests=False` is `code_output` (stdout must equal
    `TaskItem.answer`), `with_tests=True` is `code_tests` (program + tests must exit 0)."""

    def __init__(self, name: str, with_tests: bool, config: SandboxConfig | None = None,
                 **options) -> None:
        if config is not None and options:
            raise ValueError(f"{name}: pass either `config` or SandboxConfig fields, not both")
        self.name, self.with_tests = name, with_tests
        self.sandbox = LocalSandbox(config or SandboxConfig(**options))

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        start = time.monotonic()
        program, early = prepare(request, self.with_tests)
        if early is not None:
            return early
        run = await self.sandbox.run(program)
        return score_run(run, None if self.with_tests else request.item.answer, start)

    def close(self) -> None:
        pass


def code_output(config: SandboxConfig | None = None, **options) -> LocalCodeVerifier:
    """The `code_output` verifier; `options` are `SandboxConfig` fields."""
    return LocalCodeVerifier("code_output", False, config, **options)


def code_tests(config: SandboxConfig | None = None, **options) -> LocalCodeVerifier:
    """The `code_tests` verifier; `options` are `SandboxConfig` fields."""
    return LocalCodeVerifier("code_tests", True, config, **options)
