"""What the `math` verifier accepts and rejects, as a table: the documentation of its grading rules
(services/verifiers/math_answers.py, math_verifier.py). Each row is (gold, completion, status)."""

import asyncio

import pytest

from threepo.services.verifiers.math_answers import normalize_number
from threepo.services.verifiers.math_verifier import MathVerifier
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

OK, WRONG, MALFORMED = VerifyStatus.OK, VerifyStatus.WRONG, VerifyStatus.MALFORMED

TABLE = [
    # -- plain answers
    ("81", "\\boxed{81}", OK),
    ("81", "The sum is 81, so \\boxed{81}", OK),
    ("81", "\\boxed{ 81 }", OK),
    ("81", "\\boxed{80}", WRONG),
    ("-7", "\\boxed{-7}", OK),
    ("-7", "\\boxed{7}", WRONG),
    ("0", "\\boxed{0}", OK),
    # -- trailing text after the final box: punctuation and short remarks pass
    ("81", "\\boxed{81}.", OK),
    ("81", "So the answer is \\boxed{81}!", OK),
    ("81", "$\\boxed{81}$.", OK),
    ("81", "\\[\\boxed{81}\\]", OK),
    ("81", "\\(\\boxed{81}\\)", OK),
    ("81", "\\boxed{81} and that is final", OK),
    ("81", "\\boxed{81}. I hope this helps!", OK),
    ("81", "\\boxed{81}\n\n", OK),
    ("81", "\\boxed{80}.", WRONG),
    # -- ... but not a second answer, more markup, or a long tail
    ("81", "\\boxed{81} or maybe 80", MALFORMED),
    ("81", "\\boxed{81} (or 82)", MALFORMED),
    ("81", "\\boxed{81}{}{}{", MALFORMED),  # the reward hack of algorithms.md §6.3
    ("81", "\\boxed{81}}", MALFORMED),
    ("81", "\\boxed{81} \\text{units}", MALFORMED),
    ("81", "\\boxed{81}" + " and so on" * 8, MALFORMED),
    ("81", "\\boxed{81}\nQ: what is 2+2? A: \\boxed", MALFORMED),
    # -- the last box is the answer
    ("81", "\\boxed{80} no wait \\boxed{81}", OK),
    ("81", "\\boxed{81} no wait \\boxed{80}", WRONG),
    # -- format failures
    ("81", "81", MALFORMED),
    ("81", "\\boxed{81", MALFORMED),
    ("81", "\\boxed{ }", MALFORMED),
    ("81", "\\boxed 81", MALFORMED),
    # -- thousands separators: one separator throughout, groups of three
    ("1234", "\\boxed{1,234}", OK),
    ("1234", "\\boxed{1{,}234}", OK),
    ("1234", "\\boxed{1\\,234}", OK),  # math-verify alone reads this as 1 + 234
    ("1234", "\\boxed{1\\ 234}", OK),
    ("1234", "\\boxed{1 234}", OK),
    ("1234", "\\boxed{1\u2009234}", OK),
    ("1234567", "\\boxed{1,234,567}", OK),
    ("1234567.5", "\\boxed{1,234,567.5}", OK),
    ("1,234", "\\boxed{1234}", OK),  # a gold written with separators is read the same way
    ("1234", "\\boxed{12,34}", WRONG),  # not thousands groups: not a number literal
    ("1234", "\\boxed{1,2,3,4}", WRONG),
    ("1234567", "\\boxed{1,234 567}", WRONG),  # mixed separators
    ("3.5", "\\boxed{3,5}", WRONG),  # a decimal comma is ambiguous (a pair in math-verify)
    ("1234", "\\boxed{1,235}", WRONG),
    # -- signs, decimals, trailing zeros
    ("5", "\\boxed{+5}", OK),
    ("-5", "\\boxed{\u22125}", OK),  # Unicode minus
    ("5", "\\boxed{5.0}", OK),
    ("5", "\\boxed{5.00}", OK),
    ("5", "\\boxed{5.}", OK),
    ("5", "\\boxed{05}", OK),
    ("5", "\\boxed{5.01}", WRONG),
    ("0.5", "\\boxed{.5}", OK),
    ("0.25", "\\boxed{0.250}", OK),
    # -- fractions and other exact forms of the same number
    ("0.5", "\\boxed{\\frac{1}{2}}", OK),
    ("0.5", "\\boxed{\\dfrac{1}{2}}", OK),
    ("0.5", "\\boxed{1/2}", OK),
    ("\\frac{1}{2}", "\\boxed{0.5}", OK),
    ("\\frac{2}{3}", "\\boxed{0.67}", WRONG),
    ("-\\frac{1}{2}", "\\boxed{-\\frac{1}{2}}", OK),
    # -- units and labels a grader strips
    ("5", "\\boxed{\\$5}", OK),
    ("1500", "\\boxed{\\$1,500}", OK),
    ("5", "\\boxed{x = 5}", OK),
    ("5", "\\boxed{n=5}", OK),
    ("5", "\\boxed{5\\%}", OK),  # math-verify reads a percent sign as a unit here
    # -- restating the question is not an answer (require_numeric_literal)
    ("81", "\\boxed{23+58}", WRONG),
    ("81", "\\boxed{9^2}", WRONG),
    ("81", "\\boxed{--81}", WRONG),
    ("1234", "\\boxed{1000+234}", WRONG),
    ("81", "\\boxed{x = 23+58}", WRONG),
    # -- symbolic golds are compared by math-verify as written
    ("x^2+2x+1", "\\boxed{(x+1)^2}", OK),
    ("x^2+2x+1", "\\boxed{(x+1)^2}.", OK),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", OK),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", OK),
    ("\\sqrt{2}", "\\boxed{1.41}", WRONG),
    ("\\pi", "\\boxed{\\pi}", OK),
    ("(1,2)", "\\boxed{(1,2)}", OK),
    ("(1,2)", "\\boxed{(2,1)}", WRONG),
]


@pytest.fixture(scope="module")
def verifier():
    return MathVerifier()


@pytest.mark.parametrize("gold,completion,status", TABLE)
def test_equivalence_table(verifier, gold, completion, status):
    item = TaskItem(uid="t", prompt="Q: ", answer=gold)
    result = asyncio.run(verifier.verify(VerifyRequest(item, completion, "stop")))
    assert result.status is status, (gold, completion, result)
    assert result.reward == (1.0 if status is OK else 0.0)


def test_the_table_is_broad():
    assert len(TABLE) >= 60
    assert {s for *_, s in TABLE} == {OK, WRONG, MALFORMED}


@pytest.mark.parametrize("text,number", [
    ("1,234", "1234"), ("1 234", "1234"), ("+5", "5"), ("5.", "5"), ("5.000", "5"),
    ("\\$1,500", "1500"), ("x = -3", "-3"), ("7\\%", "7\\%"), ("1,23", None), ("23+58", None),
    ("1e3", None), ("abc", None),
])
def test_normalize_number(text, number):
    assert normalize_number(text) == number


def test_trailing_text_bound_is_a_setting(verifier):
    item = TaskItem(uid="t", prompt="Q: ", answer="81")
    strict = MathVerifier(max_trailing_chars=0)
    for v, status in ((verifier, OK), (strict, MALFORMED)):
        result = asyncio.run(v.verify(VerifyRequest(item, "\\boxed{81}.", "stop")))
        assert result.status is status
    with pytest.raises(ValueError, match="max_trailing_chars"):
        MathVerifier(max_trailing_chars=-1)
