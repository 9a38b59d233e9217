import asyncio
import math
import threading

import pytest

from threepo.services.verifiers import math_verifier
from threepo.services.verifiers.base import load_verifier
from threepo.services.verifiers.math_verifier import CountdownVerifier, MathVerifier, final_boxed
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

OK, WRONG, MALFORMED = VerifyStatus.OK, VerifyStatus.WRONG, VerifyStatus.MALFORMED
# math-verify cannot compare this power within its own limits (it takes > 5 s uncapped).
HANGING = "\\boxed{9^{9^{9}}}"


def item(answer, **kw):
    return TaskItem(uid=f"t/{answer}", prompt="Q: ", answer=answer, **kw)


def score(verifier, task, completion, finish_reason="stop"):
    return asyncio.run(verifier.verify(VerifyRequest(task, completion, finish_reason)))


@pytest.mark.parametrize("gold,completion,status", [
    ("81", "\\boxed{81}", OK),
    ("81", "so 23+58=81 \\boxed{81} \n", OK),
    ("81", "\\boxed{81.0}", OK),
    ("0.5", "\\boxed{\\frac{1}{2}}", OK),
    ("0.5", "\\boxed{1/2}", OK),
    ("\\frac{1}{2}", "\\boxed{0.5}", OK),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", OK),
    ("81", "\\boxed{80}", WRONG),
    ("81", "\\boxed{80} then \\boxed{81}", OK),  # the last box is the answer
    ("81", "\\boxed{81} then \\boxed{80}", WRONG),
    ("81", "\\boxed{23+58}", WRONG),  # restating the question is not an answer
    ("81", "\\boxed{--81}", WRONG),
    ("81", "81", MALFORMED),
    ("81", "\\boxed{52}{}{}{", MALFORMED),  # the reward hack of algorithms.md §6.3
    ("81", "\\boxed{81} and more", OK),  # short trailing text (test_math_equivalence.py)
    ("81", "\\boxed{81} or 80", MALFORMED),
    ("81", "\\boxed{81", MALFORMED),
    ("81", "\\boxed{ }", MALFORMED),
    ("81", "\\boxed 81", MALFORMED),
    ("81", "\\boxed{}{}", MALFORMED),
])
def test_math_statuses(gold, completion, status):
    result = score(MathVerifier(), item(gold), completion)
    assert result.status is status, result
    assert result.reward == (1.0 if status is OK else 0.0)


def test_truncated_completion_earns_nothing():
    result = score(MathVerifier(), item("81"), "\\boxed{81}", finish_reason="length")
    assert result.status is MALFORMED and result.reward == 0.0 and "truncated" in result.details
    with pytest.raises(ValueError, match="finish_reason"):
        score(MathVerifier(), item("81"), "\\boxed{81}", finish_reason="eos")


def test_final_boxed():
    assert final_boxed("a \\boxed{\\frac{1}{2}}  ") == ("\\frac{1}{2}", "")
    assert final_boxed("\\boxed{52}{}{}{")[0] is None


def test_gold_is_parsed_once_per_answer():
    math_verifier._parse_gold.cache_clear()
    verifier = MathVerifier()
    for completion in ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/3}"):
        score(verifier, item("\\frac{1}{2}"), completion)
    info = math_verifier._parse_gold.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_integers_are_compared_exactly_without_math_verify(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("math-verify was called for two integers")

    monkeypatch.setattr("math_verify.verify", refuse)
    verifier = MathVerifier()
    assert score(verifier, item("81"), "\\boxed{81}").status is VerifyStatus.OK
    assert score(verifier, item("81"), "\\boxed{1,281}").status is VerifyStatus.WRONG
    assert score(verifier, item("-7"), "\\boxed{−7}").status is VerifyStatus.OK  # a Unicode minus


def test_checker_failures_are_infra_errors_not_zero(monkeypatch):
    unparseable = score(MathVerifier(), item("}{"), "\\boxed{1}")
    assert unparseable.status is VerifyStatus.INFRA_ERROR and math.isnan(unparseable.reward)

    def broken(*args, **kwargs):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr("math_verify.verify", broken)
    result = score(MathVerifier(), item("\\frac{1}{2}"), "\\boxed{0.5}")
    assert result.status is VerifyStatus.INFRA_ERROR and math.isnan(result.reward)
    assert "sympy exploded" in result.details


def test_inline_mode_refuses_other_threads():
    errors = []

    def run():
        try:
            score(MathVerifier(), item("81"), "\\boxed{81}")
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_inline_mode_uses_math_verify_timeouts():
    verifier = MathVerifier(verify_timeout_s=1, require_numeric_literal=False)
    result = score(verifier, item("81"), HANGING)
    assert result.status is VerifyStatus.TIMEOUT and result.reward == 0.0
    assert result.latency_s < 4


def test_process_mode_kills_a_hanging_check_and_recovers():
    verifier = load_verifier("math", mode="process", deadline_s=1.0, require_numeric_literal=False)
    try:
        assert score(verifier, item("81"), "\\boxed{81.0}").status is OK
        hung = score(verifier, item("81"), HANGING)
        assert hung.status is VerifyStatus.TIMEOUT and hung.reward == 0.0, hung
        assert 1.0 <= hung.latency_s < 4
        assert "respawned" in hung.details

        async def many():
            return await asyncio.gather(*(verifier.verify(
                VerifyRequest(item("81"), f"\\boxed{{{x}}}")) for x in (80, 81, 82)))

        assert [r.status for r in asyncio.run(many())] == [WRONG, OK, WRONG]
        # A worker that dies mid-service is the checker's failure: infra_error, then a new worker.
        verifier._pool._live[0].process.kill()
        died = score(verifier, item("81"), "\\boxed{81}")
        assert died.status is VerifyStatus.INFRA_ERROR and math.isnan(died.reward), died
        assert score(verifier, item("81"), "\\boxed{81}").status is OK
    finally:
        verifier.close()


def test_config_is_validated():
    with pytest.raises(ValueError, match="mode"):
        MathVerifier(mode="threads")
    with pytest.raises(ValueError, match="deadline_s"):
        MathVerifier(deadline_s=0)
    with pytest.raises(TypeError, match="bogus"):
        load_verifier("math", bogus=1)


# --- countdown --------------------------------------------------------------------------------


@pytest.mark.parametrize("numbers,target,expression,status", [
    ((3, 4, 8), 56, "(3+4)*8", OK),
    ((3, 4, 8), 56, "8*(4+3)", OK),
    ((3, 4, 8), 11, "3+8", OK),  # not every number must be used
    ((1, 3, 4, 6), 24, "6/(1-3/4)", OK),  # through the non-integer 1/4, evaluated exactly
    ((3, 4, 8), 5, "-3+8", OK),
    ((3, 4, 8), 64, "8*8", WRONG),  # a number used twice
    ((3, 4, 8), 60, "(3+4)*8+4", WRONG),
    ((3, 4, 8), 40, "5*8", WRONG),  # 5 is not given
    ((3, 4, 8), 56, "56", WRONG),
    ((3, 4, 8), 55, "(3+4)*8", WRONG),
    ((3, 3, 8), 1, "8/(3-3)", WRONG),  # division by zero
    ((3, 4, 8), 81, "3**4", MALFORMED),
    ((3, 4, 8), 3, "abs(3)", MALFORMED),
    ((3, 4, 8), 7, "3+4=7", MALFORMED),
    ((3, 4, 8), 7, "(3+4", MALFORMED),
    ((3, 4, 8), 3, "03", MALFORMED),
    ((3, 4, 8), 7, "3 4", MALFORMED),
])
def test_countdown_statuses(numbers, target, expression, status):
    task = item(str(target), verifier="countdown", numbers=numbers)
    result = score(CountdownVerifier(), task, f"\\boxed{{{expression}}}")
    assert result.status is status, result


def test_countdown_format_rules_and_bad_items():
    task = item("56", verifier="countdown", numbers=(3, 4, 8))
    verifier = load_verifier("countdown")
    assert score(verifier, task, "\\boxed{(3+4)*8}", "length").status is MALFORMED
    assert score(verifier, task, "\\boxed{(3+4)*8}{").status is MALFORMED
    assert score(verifier, task, "(3+4)*8").status is MALFORMED
    zero = score(verifier, item("1", verifier="countdown", numbers=(3, 3, 8)), "\\boxed{8/(3-3)}")
    assert zero.details == "division by zero"
    assert score(verifier, task, "\\boxed{" + "+".join(["3"] * 150) + "}").status is MALFORMED
    with pytest.raises(ValueError, match="numbers"):
        score(verifier, item("56", verifier="countdown"), "\\boxed{56}")


def test_last_number_extraction_for_models_that_do_not_box():
    from threepo.deploy.config import load_config
    from threepo.services.verifiers.pool import VerifierPool

    item = TaskItem(uid="g", prompt="q", answer="1000")
    pool = VerifierPool(load_config(None, ['verifier.options=[["math", "answer", "last_number"]]']).verifier)
    cases = [("So Eli has 600 + 400 = 1,000 coins.", "stop", VerifyStatus.OK),
             ("So 999 coins.", "stop", VerifyStatus.WRONG),
             ("The answer is \\boxed{1000}.", "stop", VerifyStatus.OK),        # a box still counts
             ("1000 or \\boxed{N}", "stop", VerifyStatus.WRONG),              # ... by its rules, not the number
             ("600 + 400 = 1000", "length", VerifyStatus.MALFORMED),          # truncated
             ("no number at all", "stop", VerifyStatus.MALFORMED)]
    results = pool.verify_batch([VerifyRequest(item, c, f) for c, f, _ in cases])
    pool.close()
    assert [r.status for r in results] == [s for _, _, s in cases], [r.details for r in results]
    boxed = load_verifier("math")  # the default wants the box
    assert asyncio.run(boxed.verify(VerifyRequest(item, cases[0][0]))).status is VerifyStatus.MALFORMED
    with pytest.raises(ValueError, match="MathVerifierConfig.answer"):
        load_verifier("math", answer="first_number")
