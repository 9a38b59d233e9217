"""Structure rules of style.md §2, §3, §7 and §8: algorithms/ is pure, services/ has no Ray, size budgets hold,
threepo's import graph (function-level imports included) has no cycle, and only the entry point
knows deploy/cli.py.

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
FILE_BUDGET = {"algorithms": 300, "services": 400, "deploy": 400}
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


def _module_files() -> dict[str, Path]:
    """threepo's modules by dotted name ('threepo.services.learner.core': its file)."""
    out = {}
    for folder in ("algorithms", "services", "deploy"):
        for path in _py_files(folder):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(["threepo", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the threepo modules it imports anywhere in its body (function-level and TYPE_CHECKING
    imports included; `from package import module` resolves to the module; packages' empty inits are
    not nodes of their own)."""
    modules, graph = _module_files(), {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        resolved = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.count(".") > 1:
                resolved.add(target)
        graph[name] = resolved
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_hidden_circle():
    graph = {"threepo.a.x": {"threepo.a.y"}, "threepo.a.y": {"threepo.a.z"}, "threepo.a.z": {"threepo.a.x"},
             "threepo.a.w": {"threepo.a.x"}}
    assert cycles(graph) == [["threepo.a.x", "threepo.a.y", "threepo.a.z"]]
    assert cycles({"threepo.a.x": {"threepo.a.y"}, "threepo.a.y": set()}) == []


def test_the_import_graph_sees_function_level_imports():
    graph = import_graph()
    assert "threepo.deploy.commands" in graph["threepo.deploy.cli"]  # imported inside _dispatch
    assert "threepo.services.learner.optimizers" in graph["threepo.services.learner.core"]


def test_no_module_imports_in_a_circle():
    found = cycles(import_graph())
    assert not found, "import cycles (each line one circle):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_only_the_entry_point_imports_the_cli():
    importers = sorted(m for m, targets in import_graph().items() if "threepo.deploy.cli" in targets)
    bench = [f"{p.relative_to(ROOT)}: import {n}" for p in sorted((ROOT / "benchmarks").glob("*.py"))
             for n in _imports(p) if n == "threepo.deploy.cli" or n.startswith("threepo.deploy.cli.")]
    assert not importers and not bench, f"deploy/cli.py is the entry point only: {importers + bench}"


# services/ by room (docs/architecture.md §1): each room of services/ and the rooms it may import at run
# time (TYPE_CHECKING imports are annotations only). algorithms/ may be imported by any room. A new
# file in services/ joins a room; a new edge is a deliberate change of the layering, made here.
SERVICE_ROOMS = {
    "errors": set(), "metrics": set(), "checkpoint": set(),
    "wire": {"errors"},
    "model": {"errors"},
    "verifiers": {"errors", "metrics", "wire"},
    "tasks": {"errors", "model", "verifiers", "wire"},
    "sampling": {"errors", "metrics", "model", "tasks", "wire"},
    "learner": {"checkpoint", "errors", "metrics", "model", "wire"},
    "posterior": {"checkpoint", "errors", "wire"},
    "ledger": {"errors", "posterior", "wire"},
    "evaluation": {"errors", "model", "sampling", "tasks", "verifiers", "wire"},
    "bootstrap": {"errors", "evaluation", "model", "tasks", "wire"},
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "services" else None


def _runtime_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    annotations = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_services_is_laid_out_by_room():
    entries = {p.name.removesuffix(".py") for p in (ROOT / "services").iterdir()  # a folder of no code is no room
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and any(p.rglob("*.py")))}
    assert entries == set(SERVICE_ROOMS), (f"services/ holds the rooms {sorted(SERVICE_ROOMS)}; "
                                           f"not a room: {sorted(entries - set(SERVICE_ROOMS))}, "
                                           f"missing: {sorted(set(SERVICE_ROOMS) - entries)}")
    order, left = [], {room: set(deps) for room, deps in SERVICE_ROOMS.items()}
    while left:  # the rooms' layering itself has no circle
        ready = sorted(r for r, deps in left.items() if deps <= set(order))
        assert ready, f"the rooms' allowed imports form a circle among {sorted(left)}"
        order += ready
        left = {r: d for r, d in left.items() if r not in ready}


def test_each_room_imports_only_the_rooms_below_it():
    bad = []
    for path in _py_files("services"):
        room = path.relative_to(ROOT / "services").parts[0].removesuffix(".py")
        for name in _runtime_imports(path):
            target = _room(name)
            if target and target != room and target not in SERVICE_ROOMS[room]:
                bad.append(f"{path.relative_to(ROOT)}: import {name} ({room} may import {sorted(SERVICE_ROOMS[room])})")
            if name.startswith("threepo.deploy"):
                bad.append(f"{path.relative_to(ROOT)}: import {name} (services/ never imports deploy/)")
    assert not bad, "imports against the rooms' layering:\n" + "\n".join(bad)


def test_the_room_rule_sees_a_forbidden_edge(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from threepo.services.learner import core\n"
                    "def f():\n    from threepo.services.sampling.sampler import Sampler\n")
    assert [_room(n) for n in _runtime_imports(path)] == [None, "sampling"]
