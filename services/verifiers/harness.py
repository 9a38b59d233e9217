"""The test harness of `code_tests`: a program scores `ok` only when the harness says every test ran.

`harness_program(program, tests)` is the source that runs in the sandbox (locally or in the sandbox
service: the same source and the same rule both ways). The parent sends a fresh random token on the
program's stdin; the harness reads it before anything of the program runs, then runs the program and
each test statement in turn and writes one report line, `<token> <verdict> <done>/<total> <detail>`,
on a private duplicate of stdout taken before the program ran, and ends the process at once with
`os._exit` (no exit hooks, no buffered output after it). `read_report(stdout, token)` finds that line;
`code_verifiers.score_run` scores by it:

    passed n/n                      -> ok
    wrong i/n    (AssertionError in test i, whatever its message)      -> wrong
    error i/n    (another exception in test i)                        -> runtime_error
    program 0/n  (the program raised or exited before the tests)      -> runtime_error
    no report line carrying the token                                 -> runtime_error (or timeout,
                                                                         output limit as the run says)

What this holds against (each has a test in tests/services/test_code_harness.py): an early exit of any
kind before or inside the tests (`sys.exit`, `exit()`, `os._exit(0)`, `raise SystemExit`, killing its
own process), exit hooks (`atexit`) and a replaced `sys.excepthook`, a closed, redirected or replaced
stdout (`sys.stdout`, fd 1), printing a fake report (it lacks the token; stdin is emptied and its
file unlinked before the program runs), a `check` defined by the
program (the tests define theirs after it), replaced builtins (`builtins.AssertionError`, `exec`,
`compile`, `print`, `isinstance`: the harness holds its own references, and the tests run with the
builtins as they were before the program ran), and a report fd the program closes or redirects (the
report is lost: not `ok`).

What it does not hold against, being one process with the code it judges: a program that goes looking
for the harness itself — reads the token out of the harness's frame or the heap (`sys._getframe`,
`gc.get_objects`) and writes a forged report, or rewrites the running tests through a trace function
(`sys.settrace` line jumps) — and values that defeat the tests' own comparisons (an object whose
`__eq__` always answers True passes `assert candidate(x) == y`, as it does under HumanEval's harness).
Those need a test design that does not trust the candidate's objects, or a second process.
"""

from __future__ import annotations

import re
import secrets

_VERDICTS = ("passed", "wrong", "error", "program")
_DETAIL_CHARS = 300

# The harness, filled in with the program and the tests as Python literals. Every name it uses after
# the program starts is bound before it: a program that replaces builtins or module attributes
# cannot reach them.
_HARNESS = '''\
def _threepo_harness(program, tests):
    import builtins, os, sys
    token = sys.stdin.buffer.read(64).strip().decode("ascii", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the token cannot be read again from fd 0 (the sandbox unlinked the file behind it)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    report_fd = os.dup(1)
    write, end, exc_info = os.write, os._exit, sys.exc_info
    run, BaseExc, AssertionErr, SysExit = exec, BaseException, AssertionError, SystemExit
    str_, len_, dict_, enumerate_ = str, len, dict, enumerate
    builtins_before = dict(vars(builtins))

    def report(verdict, done, detail=""):
        line = "\\n%s %s %d/%d %s\\n" % (token, verdict, done, len_(tests), detail[:300].replace("\\n", " | "))
        try:
            write(report_fd, line.encode("utf-8", "replace"))
        finally:
            end(0 if verdict == "passed" else 1)

    def why():
        kind, value = exc_info()[:2]
        try:
            text = str_(value)
        except BaseExc:
            text = "<unprintable>"
        return "%s: %s" % (kind.__name__, text) if text else kind.__name__

    try:
        codes = [compile(t, "test_%d" % i, "exec") for i, t in enumerate(tests)]
        main = compile(program, "main.py", "exec")
    except BaseExc:
        report("program", 0, why())
    scope = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
    try:
        run(main, scope)
    except SysExit:
        report("program", 0, "SystemExit before the tests ran")
    except BaseExc:
        report("program", 0, why())
    scope = dict_(scope, __builtins__=builtins_before)
    for i, code in enumerate_(codes):
        try:
            run(code, scope)
        except AssertionErr:
            report("wrong", i, why())
        except SysExit:
            report("error", i, "SystemExit inside the tests")
        except BaseExc:
            report("error", i, why())
    report("passed", len_(codes))


_threepo_harness({program!r}, {tests!r})
'''


def new_token() -> str:
    """A fresh report token: 128 random bits, hex."""
    return secrets.token_hex(16)


def harness_program(program: str, tests: tuple[str, ...] | list[str]) -> str:
    """The source that runs `program` and then each of `tests` (Python statements) under the harness."""
    # one pass: a program whose text holds a marker must not have it filled in (that would splice code
    # into the harness)
    literals = {"program": repr(program), "tests": repr(tuple(tests))}
    return re.sub(r"\{(program|tests)!r\}", lambda m: literals[m.group(1)], _HARNESS)


def read_report(stdout: str, token: str) -> tuple[str, int, int, str] | None:
    """(verdict, done, total, detail) from the last report line carrying `token`, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(token + " "):
            parts = line[len(token) + 1:].split(" ", 2)
            if len(parts) >= 2 and parts[0] in _VERDICTS and "/" in parts[1]:
                done, _, total = parts[1].partition("/")
                if done.isdigit() and total.isdigit():
                    return parts[0], int(done), int(total), (parts[2] if len(parts) > 2 else "")[:_DETAIL_CHARS]
    return None


def without_report(stdout: str, token: str) -> str:
    """`stdout` without the harness's report line (what the program itself printed)."""
    return "\n".join(line for line in stdout.splitlines() if not line.startswith(token + " "))
