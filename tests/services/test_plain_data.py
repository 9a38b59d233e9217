"""Plain data across the code_tests harness's processes: every plain value round-trips exactly (by
type too), nothing else is encoded, and no text but what `encode` writes decodes."""

import math

import pytest

from threepo.services.verifiers.plain_data import MAX_DEPTH, NotPlain, decode, encode

VALUES = [None, True, False, 0, -7, 10 ** 5000, 1.5, -0.0, math.inf, -math.inf, 1e-320, 3 + 4j, "", "é\udc80",
          b"\x00\xff", [], (), {}, set(), frozenset(), [1, (2, "3"), {"k": [4.0]}], {(1, 2): {frozenset({3}): b"x"}},
          {1: "int key", 1.5: "float key", "s": None}, ((),), [[[]]]]


def _same(a, b) -> bool:
    """Equal and of the same type all the way down (nan equal to nan)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b and math.copysign(1, a) == math.copysign(1, b) or (math.isnan(a) and math.isnan(b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("value", VALUES, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(VALUES)])
def test_plain_values_round_trip_by_type(value):
    assert _same(decode(encode(value)), value)


def test_nan_round_trips():
    assert math.isnan(decode(encode(math.nan)))
    assert math.isnan(decode(encode(complex(math.nan, 1))).real)


class Yes:
    def __eq__(self, other):
        return True


class Str(str):
    pass


class Int(int):
    pass


class Lst(list):
    pass


@pytest.mark.parametrize("value", [Yes(), Str("x"), Int(3), Lst([1]), [1, Yes()], {"k": Str("v")}, {Int(1): 2},
                                   lambda: 0, object(), bytearray(b"x"), range(3), iter([1])])
def test_nothing_else_is_encoded_and_the_reason_names_the_type(value):
    with pytest.raises(NotPlain, match="type"):
        encode(value)


def test_a_value_that_contains_itself_or_nests_too_deep_is_refused():
    loop = []
    loop.append(loop)
    with pytest.raises(NotPlain, match="deeper"):
        encode(loop)
    deep = "x"
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(NotPlain):
        encode(deep)
    with pytest.raises(NotPlain):
        decode("[" * (MAX_DEPTH + 5) + '"x"' + "]" * (MAX_DEPTH + 5))


@pytest.mark.parametrize("text", ["", "1", "X", "i;", "i12", "i1_0;", "i 1;", "i1;N", "f1.5 ;", "fnan", "c1,2", "u5:abc",
                                  "u-1:", "b1:zz", "b2:ab", "l2:N", "S1:l0:", "d1:l0:N", "d1:N", "t1:i1;junk", "q"])
def test_only_what_encode_writes_decodes(text):
    with pytest.raises(NotPlain):
        decode(text)
