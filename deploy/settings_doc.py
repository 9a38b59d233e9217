"""What each setting means, read from the one place it is written: the docstring under its field.

Every config dataclass documents a field with a string literal right after it (the attribute-docstring
convention); `field_docs` reads them from the class's source with `ast`, so the meaning printed by
`threepo <cmd> --show-config` (`documented_toml`) and the settings reference in docs/settings.md
(`settings_reference`, checked against the file by tests/deploy/test_settings_doc.py) cannot drift from
the code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache
from typing import Any

from threepo.deploy.config import RunConfig, sections, to_toml, toml_value

REFERENCE = "docs/settings.md"


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, dedented} of dataclass `cls` (a field without one is absent)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _comments(section: Any, name: str | None) -> list[str]:
    """A table's summary (its docstring's first paragraph, as docs/settings.md has it), or a field's
    meaning, as TOML comments."""
    if name is None:
        return [f"# {line}".rstrip() for line in (inspect.getdoc(type(section)) or "").split("\n\n")[0].splitlines()]
    return [f"#   {line}".rstrip() for line in field_docs(type(section)).get(name, "").splitlines()]


def documented_toml(cfg: Any) -> str:
    """The resolved config as TOML with each field's meaning as comments above it (still valid TOML:
    a recipe that documents itself)."""
    return to_toml(cfg, comments=_comments)


def settings_reference(schema: type = RunConfig) -> str:
    """docs/settings.md: every setting as `section.field`, its default and its meaning, per section."""
    defaults = schema()
    out = ["# Settings reference", "",
           "Every setting of `threepo train`, `eval` and `bootstrap`, written `section.field=value` on the command",
           "line or as `field = value` under `[section]` in a recipe. Generated from the field docstrings by",
           "`python -m threepo.deploy.settings_doc > docs/settings.md` (a test fails when this file is stale);",
           "`threepo train --show-config` prints the same meanings beside a run's resolved values. Defaults",
           "shown are those of the embedded default run (a value resolved from others, such as",
           "`sampler.max_new_tokens` or `optim.lr = \"auto\"`, shows what it resolves to there).", ""]
    for name, section, scalars in sections(defaults):
        docs = field_docs(type(section))
        title = f"`[{name}]`" if name else "Top level"
        summary = (inspect.getdoc(type(section)) or "").split("\n\n")[0].replace("\n", " ")
        out += [f"## {title}", "", f"{summary} (`{type(section).__module__}.{type(section).__name__}`)", "",
                "| setting | default | meaning |", "|---|---|---|"]
        for f in scalars:
            key = f"{name}.{f.name}" if name else f.name
            meaning = docs.get(f.name, "").replace("\n", " ").replace("|", "\\|")
            value = toml_value(getattr(section, f.name)).replace("|", "\\|")
            out.append(f"| `{key}` | `{value}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def undocumented(schema: type = RunConfig) -> list[str]:
    """`section.field` of every setting without a docstring."""
    return [f"{name}.{f.name}" if name else f.name for name, section, scalars in sections(schema())
            for f in scalars if f.name not in field_docs(type(section))]


if __name__ == "__main__":
    print(settings_reference(), end="")
