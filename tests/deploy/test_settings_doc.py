"""The meaning of every setting comes from its field's docstring: --show-config and docs/settings.md."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from threepo.deploy.config import load_config
from threepo.deploy.settings_doc import REFERENCE, documented_toml, field_docs, settings_reference, undocumented

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class _Toy:
    documented: int = 1
    """What it means,
    over two lines."""
    bare: int = 2
    also: str = "x"
    """Its meaning."""


def test_field_docs_reads_the_string_under_each_field():
    assert field_docs(_Toy) == {"documented": "What it means,\nover two lines.", "also": "Its meaning."}


def test_every_setting_has_a_meaning():
    assert undocumented() == []


def test_the_settings_reference_is_current():
    assert (ROOT / REFERENCE).read_text() == settings_reference(), (
        f"{REFERENCE} is stale: python -m threepo.deploy.settings_doc > {REFERENCE}")


def test_show_config_is_a_recipe_that_documents_itself(tmp_path):
    cfg = load_config("grpo_baseline", ["runtime.steps=7", "eval.samples_per_item=2"])
    text = documented_toml(cfg)
    assert tomllib.loads(text)["runtime"]["steps"] == 7
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    assert load_config(str(path)) == cfg
    lines = text.splitlines()
    above = lines[lines.index("k = 2") - 1]
    assert above.startswith("#") and "samples_per_item" in above  # eval.k's meaning, right above it
