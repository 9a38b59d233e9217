"""Code verifiers on the local sandbox: extraction, every status, and loading by name."""

import asyncio
import math
import shutil

import pytest

from threepo.services.verifiers.base import load_verifier
from threepo.services.verifiers.code_verifiers import extract_program, normalize_output, score_run
from threepo.services.verifiers.sandbox import RunResult, RunStatus, SandboxConfig, SandboxUnavailableError
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing: apt-get install -y bubblewrap")


def test_extract_program_prefers_last_fence_then_last_box():
    text = "```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n\\boxed{print(3)}"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("A: \\boxed{print({1: 2}[1])} and \\boxed{print({'a': 1})}") \
        == "print({'a': 1})"
    assert extract_program("no program here") is None
    assert extract_program("\\boxed{print(1)") is None  # never closes
    assert extract_program("```python\n   \n```") is None


def test_normalize_output_ignores_trailing_whitespace_only():
    assert normalize_output("84  \n\n") == "84"
    assert normalize_output("a \nb\n") == "a\nb"
    assert normalize_output(" 84") != normalize_output("84")


def item(answer="84", tests=()):
    return TaskItem(uid="t1", prompt="Q: print 12 times 7 A: ", answer=answer,
                    verifier="code_output", tests=tests)


def verify(name, completion, it=None, **opts):
    verifier = load_verifier(name, **opts)
    return asyncio.run(verifier.verify(VerifyRequest(it or item(), completion)))


@needs_bwrap
@pytest.mark.parametrize("completion, status, reward", [
    ("\\boxed{print(12*7)}", VerifyStatus.OK, 1.0),
    ("\\boxed{print(12*8)}", VerifyStatus.WRONG, 0.0),
    ("84", VerifyStatus.MALFORMED, 0.0),
    ("\\boxed{print(12*)}", VerifyStatus.COMPILE_ERROR, 0.0),
    ("\\boxed{print(1/0)}", VerifyStatus.RUNTIME_ERROR, 0.0),
    ("```python\nwhile True:\n    pass\n```", VerifyStatus.TIMEOUT, 0.0),
])
def test_code_output_statuses(completion, status, reward):
    r = verify("code_output", completion, wall_timeout_s=1.0)
    assert r.status is status, r.details
    assert r.reward == reward


@needs_bwrap
def test_code_tests_pass_fail_and_error():
    it = item(tests=("assert f(2) == 4", "assert f(3) == 9"))
    ok = verify("code_tests", "```python\ndef f(x):\n    return x * x\n```", it)
    wrong = verify("code_tests", "```python\ndef f(x):\n    return x + x\n```", it)
    crash = verify("code_tests", "```python\ndef f(x):\n    return x.y\n```", it)
    assert (ok.status, ok.reward) == (VerifyStatus.OK, 1.0)
    assert wrong.status is VerifyStatus.WRONG and "AssertionError" in wrong.details
    assert crash.status is VerifyStatus.RUNTIME_ERROR and "AttributeError" in crash.details
    with pytest.raises(ValueError, match="TaskItem.tests"):
        verify("code_tests", "\\boxed{print(1)}")


def test_sandbox_failure_is_infra_error_with_nan_reward():
    run = RunResult(RunStatus.SANDBOX_ERROR, 1, "", "bwrap: cannot create namespace", 0.0)
    r = score_run(run, "84", 0.0)
    assert r.status is VerifyStatus.INFRA_ERROR and math.isnan(r.reward)


def test_unknown_verifier_name_lists_known_ones():
    with pytest.raises(KeyError, match="code_output"):
        load_verifier("no_such_verifier")


@needs_bwrap
def test_sandbox_that_cannot_start_is_infra_error_not_zero():
    verifier = load_verifier("code_output")
    request = VerifyRequest(item(), "\\boxed{print(12*7)}")
    assert asyncio.run(verifier.verify(request)).status is VerifyStatus.OK  # probe passed
    verifier.sandbox.config = SandboxConfig(python="/nonexistent/bin/python3")  # breaks later
    r = asyncio.run(verifier.verify(request))
    assert r.status is VerifyStatus.INFRA_ERROR and math.isnan(r.reward), r.details


@needs_bwrap
def test_misconfigured_sandbox_refuses_at_first_use():
    with pytest.raises(SandboxUnavailableError, match="cannot build a sandbox"):
        verify("code_output", "\\boxed{print(12*7)}", python="/nonexistent/bin/python3")
