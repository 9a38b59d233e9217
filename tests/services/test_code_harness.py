"""The code_tests harness: `ok` only when every test provably ran, for every early-exit and tamper
route named in services/verifiers/harness.py; the same statuses and details locally and through the
sandbox service; HumanEval-shaped completions (body only, fenced, several blocks)."""

import asyncio
import os
import shutil
import signal
import sys

import pytest
from test_remote_sandbox import client_config, serve

from threepo.services.verifiers.code_verifiers import code_output, code_tests, extract_program, program_of
from threepo.services.verifiers.harness import program_files, read_report, run_message, runner_source
from threepo.services.verifiers.remote import RemoteSandboxVerifier
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap missing: apt-get install -y bubblewrap")

PREFIX = 'def add(a, b):\n    """The sum of a and b."""\n'
ITEM = TaskItem(uid="HumanEval/x", prompt=PREFIX, answer="", verifier="code_tests", code_prefix=PREFIX,
                entry_point="add", tests=("def check(candidate):\n    assert candidate(2, 3) == 5\n"
                                          "    assert candidate(-1, 1) == 0\n", "check(add)"))
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


# (name, completion, expected status): none may be ok
TAMPERS = [
    ("sys.exit before the tests", fenced(WRONG + "import sys\nsys.exit(0)\n"), VerifyStatus.RUNTIME_ERROR),
    ("raise SystemExit", fenced(WRONG + "raise SystemExit(0)\n"), VerifyStatus.RUNTIME_ERROR),
    ("os._exit before the tests", fenced(WRONG + "import os\nos._exit(0)\n"), VerifyStatus.RUNTIME_ERROR),
    ("os._exit inside the entry point", fenced("def add(a, b):\n    import os\n    os._exit(0)\n"),
     VerifyStatus.RUNTIME_ERROR),
    ("sys.exit inside the entry point", fenced("def add(a, b):\n    import sys\n    sys.exit(0)\n"),
     VerifyStatus.RUNTIME_ERROR),
    ("KeyboardInterrupt inside the entry point", fenced("def add(a, b):\n    raise KeyboardInterrupt\n"),
     VerifyStatus.RUNTIME_ERROR),
    ("killing its own process", fenced(WRONG + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"),
     VerifyStatus.RUNTIME_ERROR),
    ("an atexit hook", fenced(WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n"),
     VerifyStatus.WRONG),
    ("a replaced excepthook", fenced(WRONG + "import sys\nsys.excepthook = lambda *a: None\n"), VerifyStatus.WRONG),
    ("stdout replaced and fd 1 closed", fenced(WRONG + "import io, os, sys\nsys.stdout = io.StringIO()\nos.close(1)\n"),
     VerifyStatus.WRONG),
    ("a printed fake report", fenced(WRONG + "import os\nfor t in ('0' * 32, 'f' * 32, ''):\n"
                                     "    print(t, 'passed 2/2 all')\nos._exit(0)\n"), VerifyStatus.RUNTIME_ERROR),
    ("its own check", fenced("def check(candidate):\n    pass\n" + WRONG), VerifyStatus.WRONG),
    ("replaced builtins", fenced(WRONG + "import builtins\nbuiltins.AssertionError = KeyError\n"
                                 "builtins.exec = lambda *a, **k: None\nbuiltins.len = lambda x: 0\n"
                                 "builtins.compile = lambda *a, **k: None\nbuiltins.enumerate = lambda x: []\n"
                                 "builtins.dict = lambda *a, **k: {}\n"),
     VerifyStatus.RUNTIME_ERROR),  # its process's builtins, the program side's own included: it cannot answer
    ("its channel to the tests closed", fenced(RIGHT + "import os\nfor fd in range(3, 4096):\n    try:\n        os.close(fd)\n"
                                    "    except OSError:\n        pass\n"), VerifyStatus.RUNTIME_ERROR),
    ("a pass body", "    pass\n", VerifyStatus.WRONG),
    ("the token read again from stdin", fenced(WRONG + "import os, sys\nfor path in ('.stdin', '/proc/self/fd/0'):\n"
                                              "    try:\n        t = open(path).read().strip()\n"
                                              "    except OSError:\n        continue\n"
                                              "    if t:\n        os.write(1, f'\\n{t} passed 2/2 x\\n'.encode())\n"
                                              "        os._exit(0)\n"), VerifyStatus.WRONG),
]


def local(completion: str, item: TaskItem = ITEM):
    verifier = code_tests if item.verifier == "code_tests" else code_output
    return asyncio.run(verifier(wall_timeout_s=5.0).verify(VerifyRequest(item, completion)))


@pytest.mark.parametrize("name, completion, status", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_no_early_exit_or_tamper_route_is_ok(name, completion, status):
    r = local(completion)
    assert r.status is status, (name, r.details)
    assert r.reward == 0.0


def test_every_test_ran_is_ok_in_each_completion_form():
    for completion in ("    return a + b\n",                                 # body only, HumanEval's native form
                       fenced(RIGHT),                                         # the whole function
                       "```Python\n" + RIGHT + "```",                         # a capitalised fence
                       fenced(RIGHT) + "Usage:\n```python\nprint(add(1, 2))\n```\n"):  # an example after it
        r = local(completion)
        assert r.status is VerifyStatus.OK and r.details == "all 2 tests passed", (completion, r.details)


def test_statuses_mean_one_thing():
    multi_line = TaskItem(uid="m", prompt="", answer="", verifier="code_tests",
                          tests=("assert add(1, 1) == 3, 'first line\\nsecond line'",))
    r = local(fenced(RIGHT), multi_line)
    assert r.status is VerifyStatus.WRONG and "first line | second line" in r.details
    r = local(fenced(RIGHT + "print('x' * 10 ** 7)\n"))
    assert (r.status, r.details) == (VerifyStatus.RUNTIME_ERROR, "output limit exceeded")
    killed = TaskItem(uid="k", prompt="", answer="", verifier="code_output")
    r = local("\\boxed{import os, signal; os.kill(os.getpid(), signal.SIGKILL)}", killed)
    assert r.status is VerifyStatus.RUNTIME_ERROR, r.details  # not a timeout
    r = local(fenced(RIGHT + "while True:\n    pass\n"))
    assert r.status is VerifyStatus.TIMEOUT


def test_program_selection_and_joining():
    example = "```python\nprint(add(1, 2))\n```"
    assert extract_program(fenced(RIGHT) + example, "add") == RIGHT  # the block defining the entry point
    assert extract_program(fenced(RIGHT) + example) == "print(add(1, 2))\n"  # without one: the last block
    assert program_of("    return a + b\n", ITEM) == PREFIX + "    return a + b\n"
    assert program_of(fenced(RIGHT), ITEM) == RIGHT  # defines add: not joined
    assert program_of("```PY\n    return 1\n```", ITEM) == PREFIX + "    return 1\n"


def test_a_report_needs_the_token():
    assert read_report("x\ntok passed 2/2 \n", "tok") == ("passed", 2, 2, "")
    assert read_report("x\nother passed 2/2 \n", "tok") is None
    assert read_report("tok passed two\n", "tok") is None
    main, files = program_files("print(1)", (5, 6), "/nonexistent/python3")  # another interpreter: source
    assert files["program.py"] == b"print(1)" and "print(1)" not in main and "_threepo_program_side" in main
    assert "print(1)" not in runner_source(7)  # the tests' process never has the program
    assert b"assert True" in run_message(("assert True",), 1.0, "tok", 1)
    assert "assert True" not in main  # nor the program's process the tests
    main, files = program_files("print(1)", (5, 6), sys.executable)  # this interpreter: compiled
    assert "harness.bin" in files and len(main.splitlines()) == 3
    r = local(fenced(RIGHT + "x = '{tests!r}' + \"{program!r}\"\n"))
    assert r.status is VerifyStatus.OK


async def _remote_statuses(completions: list[str]) -> list:
    runner, url = await serve()  # the sandbox service on loopback, as test_remote_sandbox starts it
    verifier = RemoteSandboxVerifier(client_config(url, queue_timeout_s=30.0))
    try:
        return await asyncio.gather(*(verifier.verify(VerifyRequest(ITEM, c)) for c in completions))
    finally:
        await verifier.aclose()
        await runner.cleanup()


@pytest.mark.slow
def test_the_sandbox_service_scores_every_tampering_as_the_local_verifier_does():
    completions = [c for _, c, _ in TAMPERS] + ["    return a + b\n", fenced(RIGHT + "print('x' * 10 ** 7)\n")]
    remote = asyncio.run(_remote_statuses(completions))
    for completion, r in zip(completions, remote):
        mine = local(completion)
        assert (r.status, r.details.split(":")[0]) == (mine.status, mine.details.split(":")[0]), completion


def _item(tests: str, entry: str = "f") -> TaskItem:
    return TaskItem(uid="t", prompt="", answer="", verifier="code_tests", entry_point=entry, tests=(tests, f"check({entry})"))


def test_the_tests_get_exceptions_mutations_and_modules_across_the_processes():
    # a builtin exception raised by the program is that exception in the tests' process (tests may expect it)
    raises = _item("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError as e:\n"
                   "        assert 'negative' in str(e)\n    else:\n        raise AssertionError('no ValueError')\n")
    program = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    assert local(fenced(program), raises).status is VerifyStatus.OK
    r = local(fenced("class Bad(Exception):\n    pass\ndef f(x):\n    raise Bad('no')\n"), raises)
    assert r.status is VerifyStatus.RUNTIME_ERROR and "ProgramError: Bad: no" in r.details  # not a builtin type
    # a list the program changes in place is changed in the tests' process too
    sorts = _item("def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) is None\n    assert xs == [1, 2, 3]\n")
    assert local(fenced("def f(xs):\n    xs.sort()\n"), sorts).status is VerifyStatus.OK
    assert local(fenced("def f(xs):\n    sorted(xs)\n"), sorts).status is VerifyStatus.WRONG
    # a stdlib module the program imported (HumanEval's prompts do) is the tests' own import of it
    uses_math = _item("def check(candidate):\n    assert math.sqrt(candidate(16)) == 2.0\n")
    assert local(fenced("import math\ndef f(x):\n    return math.sqrt(x)\n"), uses_math).status is VerifyStatus.OK


def test_what_cannot_cross_fails_the_test_with_its_reason():
    r = local(fenced("def f(x):\n    return iter([x])\n"), _item("def check(candidate):\n    assert list(candidate(1)) == [1]\n"))
    assert r.status is VerifyStatus.RUNTIME_ERROR and "not plain data" in r.details and "list_iterator" in r.details
    r = local(fenced("def f(g):\n    return 1\n"), _item("def check(candidate):\n    assert candidate(lambda: 1) == 1\n"))
    assert r.status is VerifyStatus.RUNTIME_ERROR and "an argument is not plain data" in r.details
    r = local(fenced("def f(x):\n    while True:\n        pass\n"), _item("def check(candidate):\n    candidate(1)\n"))
    assert r.status is VerifyStatus.TIMEOUT and "in a call to f" in r.details


def test_the_trusted_runner_is_one_per_sandbox_and_comes_back_after_it_dies():
    from threepo.services.verifiers.split_run import _RUNNERS

    verifier = code_tests(wall_timeout_s=5.0)

    async def twice():
        first = await verifier.verify(VerifyRequest(ITEM, fenced(RIGHT)))
        runner = _RUNNERS[verifier.sandbox]
        pid = runner.proc.pid
        os.killpg(pid, signal.SIGKILL)  # the runner's whole sandbox
        runner.proc.wait()
        second = await verifier.verify(VerifyRequest(ITEM, fenced(RIGHT)))
        return first, second, pid, runner.proc.pid

    first, second, before, after = asyncio.run(twice())
    assert first.status is second.status is VerifyStatus.OK and before != after


def test_a_fork_bomb_is_the_programs_failure_not_the_infrastructures():
    r = local(fenced("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + RIGHT))
    assert r.status in (VerifyStatus.TIMEOUT, VerifyStatus.RUNTIME_ERROR), r.details
