"""Finding the final answer in a completion and writing numbers one way: the pure text rules of
the math and countdown verifiers (services/verifiers/math_verifier.py), table-tested in
tests/services/test_math_equivalence.py.

The final answer is the content of the last `\\boxed{...}`. What may follow its closing brace
(`final_boxed`): up to `max_trailing_chars` of text with no digit, no brace and no backslash other
than the math closers `\\]` and `\\)` — sentence punctuation, `$`, a short remark ("I hope this
helps."). A second number after the box (hedging: "or maybe 53"), more braces (the `\\boxed{52}{}{}{`
reward hack of algorithms.md §6.3), a LaTeX command or a long tail is `malformed`.

Number formats (`normalize_number`), what a grader would accept for the number 1234:
- thousands separators, the same one throughout and groups of exactly three digits: `1,234`,
  `1{,}234`, `1\\,234`, `1\\ 234`, `1 234` (space, thin space U+2009, narrow no-break space U+202F);
  `1,23`, `12,34` and a decimal comma (`3,5`) are not numbers (math-verify reads them as sets);
- a leading `+`, a Unicode minus `−`, a trailing `.` or `.0` (`1234.`, `1234.00`), a leading
  currency `\\$`, a trailing `\\%` (math-verify reads it as /100), `x = 1234` (one variable);
Everything else is left to math-verify as written.
"""

from __future__ import annotations

import re

# A number literal after normalisation: integer, decimal, fraction, optionally a percent.
NUMBER = re.compile(r"[+-]?(\d+(\.\d+)?|\.\d+|\\[dt]?frac\{\d+\}\{\d+\}|\d+/\d+)(\\%)?")
_SEPARATORS = (",", "{,}", "\\,", "\\ ", "\\;", " ", "\u2009", "\u202f")
_GROUPED = r"(\d{{1,3}})((?:{sep}\d{{3}})+)(\.\d+)?(\\%)?"  # str.format(sep=...) fills the separator
_ASSIGNMENT = re.compile(r"[A-Za-z]\s*=\s*")
_ALLOWED_CLOSERS = ("\\]", "\\)")


NO_BOX = "no \\boxed{...} answer"  # final_boxed's reason when a completion has no box at all


def final_boxed(completion: str, max_trailing_chars: int = 64) -> tuple[str | None, str]:
    """The content of the last `\\boxed{...}` and "", or None and why it is malformed (`NO_BOX`: none)."""
    start = completion.rfind("\\boxed{")
    if start < 0:
        return None, NO_BOX
    depth, end = 0, -1
    for pos in range(start + len("\\boxed"), len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[pos], 0)
        if depth == 0:
            end = pos
            break
    if end < 0:
        return None, "unclosed \\boxed{"
    why = _trailing_problem(completion[end + 1:].strip(), max_trailing_chars)
    if why:
        return None, why
    content = completion[start + len("\\boxed{"):end].strip()
    if not content:
        return None, "empty \\boxed{}"
    return content, ""


def _trailing_problem(rest: str, max_chars: int) -> str:
    """Why the text after the final box makes the completion malformed, or ""."""
    if len(rest) > max_chars:
        return f"{len(rest)} characters after the boxed answer (at most {max_chars}): {rest[:20]!r}"
    bare = rest
    for closer in _ALLOWED_CLOSERS:
        bare = bare.replace(closer, "")
    bad = next((ch for ch in bare if ch.isdigit() or ch in "{}\\"), None)
    if bad is not None:
        return f"{bad!r} after the boxed answer (a second answer or more markup): {rest[:20]!r}"
    return ""


def normalize_number(text: str) -> str | None:
    """`text` written as a plain number literal (see the module docstring), or None if it is not
    one of the accepted number formats."""
    s = text.strip().replace("\u2212", "-")
    assignment = _ASSIGNMENT.match(s)
    if assignment:
        s = s[assignment.end():]
    sign = ""
    if s[:1] in "+-":
        sign, s = ("-" if s[0] == "-" else ""), s[1:].lstrip()
    s = s.removeprefix("\\$").lstrip()
    for sep in _SEPARATORS:
        grouped = re.fullmatch(_GROUPED.format(sep=re.escape(sep)), s)
        if grouped:
            s = grouped[1] + grouped[2].replace(sep, "") + (grouped[3] or "") + (grouped[4] or "")
            break
    s = re.sub(r"^(\d+)\.(?:0*)(?=(\\%)?$)", r"\1", s)  # 1234. and 1234.00 -> 1234
    s = sign + s
    return s if NUMBER.fullmatch(s) else None


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` (thousands separators kept for `normalize_number`, a
    sentence's full stop not taken as a decimal point), or None: GSM8K's flexible extraction."""
    found = _LAST_NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None
