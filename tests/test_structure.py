"""Structure rules of style.md §6 and §4.8: algorithms/ is pure, services/ has no Ray, size budgets hold.

Prints the size table; raising a budget is a deliberate change explained in its commit.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_ALGORITHM_IMPORTS = {"torch", "numpy", "math", "typing", "dataclasses", "__future__"}
FORBIDDEN_EVERYWHERE_IN_ALGORITHMS = {"torch.distributed", "logging", "os", "io", "socket", "pathlib", "shutil"}
FILE_BUDGET = {"algorithms": 300, "services": 400}
FUNCTION_BUDGET, RUN_BUDGET = 60, 150


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def _py_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_algorithms_import_only_stdlib_torch_numpy_and_each_other():
    bad = []
    for path in _py_files("algorithms"):
        for name in _imports(path):
            top = name.split(".")[0]
            ok = (top in ALLOWED_ALGORITHM_IMPORTS or name.startswith("threepo.algorithms")
                  or top in sys.stdlib_module_names)
            if not ok or any(name == f or name.startswith(f + ".") for f in FORBIDDEN_EVERYWHERE_IN_ALGORITHMS):
                bad.append(f"{path.relative_to(ROOT)}: import {name}")
    assert not bad, "algorithms/ must stay pure:\n" + "\n".join(bad)


def test_services_do_not_import_ray():
    bad = [f"{p.relative_to(ROOT)}: import {n}" for p in _py_files("services") for n in _imports(p)
           if n.split(".")[0] == "ray"]
    assert not bad, "Ray lives in deploy/ only:\n" + "\n".join(bad)


def test_package_inits_are_empty():
    for folder in ("algorithms", "services"):
        assert (ROOT / folder / "__init__.py").read_text().strip() == "", f"{folder}/__init__.py must stay empty"


def test_importing_algorithms_pulls_in_nothing_heavy():
    modules = [f"threepo.algorithms.{p.stem}" for p in _py_files("algorithms") if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "heavy = [m for m in ('ray', 'transformers', 'vllm', 'sglang', 'threepo.services', 'threepo.deploy')"
            " if m in sys.modules]\nprint(heavy)\nassert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _function_sizes(path: Path) -> list[tuple[str, int]]:
    sizes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sizes.append((node.name, node.end_lineno - node.lineno + 1))
    return sizes


def test_size_budgets(capsys):
    rows, over = [], []
    for folder in ("algorithms", "services", "deploy"):
        for path in _py_files(folder):
            rel = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            budget = FILE_BUDGET.get(folder)
            rows.append(f"{rel:<48} {lines:>5} lines  (budget {budget or '-'})")
            if budget and lines > budget:
                over.append(f"{rel}: {lines} lines > {budget}")
            for name, size in _function_sizes(path):
                limit = RUN_BUDGET if (rel == "deploy/run.py" and name == "run") else FUNCTION_BUDGET
                if size > limit:
                    over.append(f"{rel}::{name}: {size} lines > {limit}")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert not over, "size budgets exceeded:\n" + "\n".join(over)
