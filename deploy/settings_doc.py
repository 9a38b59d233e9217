"""What each setting means, read from the one place it is written: the docstring under its field.

Every config dataclass documents a field with a string literal right after it (the attribute-docstring
convention); `field_docs` reads them from the class's source with `ast`, so the meaning printed by
`threepo <cmd> --show-config` (`documented_toml`) and the settings reference in docs/settings.md
(`settings_reference`, checked against the file by tests/deploy/test_settings_doc.py) cannot drift from
the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from typing import Any

from threepo.deploy.config import RunConfig, toml_value

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


def _sections(cfg: Any) -> list[tuple[str, Any]]:
    """('', the top-level scalars' dataclass) then (section name, section) in declaration order."""
    return [("", cfg)] + [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                          if dataclasses.is_dataclass(getattr(cfg, f.name))]


def _scalars(section: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(section) if not dataclasses.is_dataclass(getattr(section, f.name))]


def documented_toml(cfg: Any) -> str:
    """The resolved config as TOML with each field's meaning as comments above it (still valid TOML:
    a recipe that documents itself)."""
    out = []
    for name, section in _sections(cfg):
        if name:
            out.append(f"\n[{name}]")
            out += [f"# {line}".rstrip() for line in (inspect.getdoc(type(section)) or "").splitlines()[:1]]
        docs = field_docs(type(section))
        for f in _scalars(section):
            out += [f"#   {line}".rstrip() for line in docs.get(f.name, "").splitlines()]
            out.append(f"{f.name} = {toml_value(getattr(section, f.name))}")
    return "\n".join(out).lstrip("\n") + "\n"


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
    for name, section in _sections(defaults):
        docs = field_docs(type(section))
        title = f"`[{name}]`" if name else "Top level"
        summary = (inspect.getdoc(type(section)) or "").split("\n\n")[0].replace("\n", " ")
        out += [f"## {title}", "", f"{summary} (`{type(section).__module__}.{type(section).__name__}`)", "",
                "| setting | default | meaning |", "|---|---|---|"]
        for f in _scalars(section):
            key = f"{name}.{f.name}" if name else f.name
            meaning = docs.get(f.name, "").replace("\n", " ").replace("|", "\\|")
            value = toml_value(getattr(section, f.name)).replace("|", "\\|")
            out.append(f"| `{key}` | `{value}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def undocumented(schema: type = RunConfig) -> list[str]:
    """`section.field` of every setting without a docstring."""
    return [f"{name}.{f.name}" if name else f.name for name, section in _sections(schema())
            for f in _scalars(section) if f.name not in field_docs(type(section))]


if __name__ == "__main__":
    print(settings_reference(), end="")
