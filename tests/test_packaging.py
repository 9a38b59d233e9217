"""The built wheel (not only the editable install) installs every module under `threepo.*`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_code_folder_is_a_listed_package():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p.parent for top in ("algorithms", "services", "deploy") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    expected = {"threepo." + ".".join(f.relative_to(ROOT).parts) for f in folders}
    assert expected <= packages, f"add to pyproject [tool.setuptools] packages: {sorted(expected - packages)}"


@pytest.mark.slow
def test_built_wheel_imports(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True)
    wheel = next((tmp_path / "dist").glob("threepo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "threepo/algorithms/ivon.py" in names and "threepo/deploy/configs/default.toml" in names
    assert not any(n.startswith(("algorithms/", "services/", "deploy/", "tests/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True)
    modules = sorted({n[:-3].replace("/", ".") for n in names if n.endswith(".py") and "__init__" not in n})
    code = (f"import sys; sys.path.insert(0, {str(target)!r})\n"
            "import importlib\n"
            f"for m in {modules!r}:\n"
            "    mod = importlib.import_module(m)\n"
            f"    assert mod.__file__.startswith({str(target)!r}), (m, mod.__file__)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
