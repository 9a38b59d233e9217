"""Plain data across the code_tests harness's two processes (services/verifiers/harness.py): what
a test's call sends to the program's process and what comes back.

Plain data is None, bool, int, float (nan and ±inf included), complex, str, bytes, and list, tuple,
dict, set and frozenset of plain data, each by its exact type: a subclass of str or int, or an object
with its own `__eq__`, is not plain data, so no object of the program's making ever reaches the tests.
`encode` writes a value as text, prefix notation, one tag a value: `N` `T` `F`; `i<hex>;` an int (no
digit limit applies to hex); `f<float.hex>;` a float, exact; `c<hex>,<hex>;` a complex; `u<n>:` and n
characters, a str; `b<n>:` and 2n hex digits, bytes; `l` `t` `S` `Z` (list, tuple, set, frozenset)
`<n>:` and n values; `d<n>:` and n key, value pairs in insertion order. `decode` reads exactly that
and nothing else, at most `MAX_DEPTH` deep. Both raise `NotPlain` with a reason naming the type or
the place. This file is also the source both harness processes embed (they run with no site-packages
and without threepo): it imports nothing, since an import costs each process milliseconds.
"""

MAX_DEPTH = 100


class NotPlain(Exception):
    """A value, or a received text, that is not plain data."""


def encode(value) -> str:
    """`value` as text; `NotPlain` naming the first value that is not plain data."""
    out = []

    def put(v, depth):
        if depth > MAX_DEPTH:
            raise NotPlain(f"nested deeper than {MAX_DEPTH} levels (a value that contains itself?)")
        t = type(v)
        if v is None:
            out.append("N")
        elif t is bool:
            out.append("T" if v else "F")
        elif t is int:
            out.append(f"i{v:x};")
        elif t is float:
            out.append(f"f{v.hex()};")
        elif t is complex:
            out.append(f"c{v.real.hex()},{v.imag.hex()};")
        elif t is str:
            out.append(f"u{len(v)}:")
            out.append(v)
        elif t is bytes:
            out.append(f"b{len(v)}:{v.hex()}")
        elif t in _SEQUENCES:
            out.append(f"{_SEQUENCES[t]}{len(v)}:")
            for x in v:
                put(x, depth + 1)
        elif t is dict:
            out.append(f"d{len(v)}:")
            for k, x in v.items():
                put(k, depth + 1)
                put(x, depth + 1)
        else:
            raise NotPlain(f"a value of type {_type_name(t)} is not plain data")

    put(value, 0)
    return "".join(out)


def decode(text: str):
    """The value `encode` wrote; `NotPlain` for any other text."""
    if type(text) is not str:
        raise NotPlain("expected text")
    at = [0]

    def until(end):
        stop = text.find(end, at[0])
        if stop < 0 or stop - at[0] > 1 << 26:
            raise NotPlain(f"a value without its {end!r} at {at[0]}")
        piece, at[0] = text[at[0]:stop], stop + 1
        return piece

    def count():
        piece = until(":")
        if not piece.isdigit() or not piece.isascii() or len(piece) > 12:
            raise NotPlain(f"a malformed length {piece[:20]!r}")
        return int(piece)

    def take(n):
        if at[0] + n > len(text):
            raise NotPlain("the text ends inside a value")
        piece, at[0] = text[at[0]:at[0] + n], at[0] + n
        return piece

    def get(depth):
        if depth > MAX_DEPTH:
            raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
        tag = take(1)
        try:
            if tag in _CONSTANTS:
                return _CONSTANTS[tag]
            if tag == "i":
                return int(_hex(until(";")), 16)
            if tag == "f":
                return float.fromhex(_hex(until(";"), float_=True))
            if tag == "c":
                real, imag = until(","), until(";")
                return complex(float.fromhex(_hex(real, float_=True)), float.fromhex(_hex(imag, float_=True)))
            if tag == "u":
                return take(count())
            if tag == "b":
                return bytes.fromhex(_hex(take(2 * count())))
            if tag in _BUILDERS:
                return _BUILDERS[tag]([get(depth + 1) for _ in range(count())])
            if tag == "d":
                pairs = [(get(depth + 1), get(depth + 1)) for _ in range(count())]
                return dict(pairs)
        except (ValueError, TypeError, OverflowError) as err:
            raise NotPlain(f"a malformed {tag!r} value: {type(err).__name__}: {err}") from None
        raise NotPlain(f"an unknown tag {tag!r} at {at[0] - 1}")

    value = get(0)
    if at[0] != len(text):
        raise NotPlain(f"{len(text) - at[0]} characters after the value")
    return value


def _hex(piece: str, float_: bool = False) -> str:
    """`piece` when it is what `encode` writes for a number (ASCII, no spaces or underscores)."""
    if not piece or piece.strip("0123456789abcdefx.p+-in" if float_ else "0123456789abcdef-"):
        raise ValueError(f"not a number as written: {piece[:20]!r}")
    return piece


def _type_name(t) -> str:
    module = getattr(t, "__module__", "") or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", "?")
    return name if module in ("builtins", "") else f"{module}.{name}"


_CONSTANTS = {"N": None, "T": True, "F": False}
_SEQUENCES = {list: "l", tuple: "t", set: "S", frozenset: "Z"}
_BUILDERS = {"l": list, "t": tuple, "S": set, "Z": frozenset}
