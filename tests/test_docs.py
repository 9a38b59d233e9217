"""Every citation of a design document names a file in docs/ and a section that file has (docs/README.md),
and every repository path the tree names exists.

A citation is `<name>.md` for a design document's name, optionally followed on its line by `§n.m`
references; a bare `§n.m` on a line that names no design document before it cites docs/algorithms.md.
Sections are cited by number, not by title or role name (titles change without the citations noticing).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Names the project's design documents had or have: a citation of any of them must resolve in docs/.
DESIGN_NAMES = ("algorithms", "architecture", "operations", "style", "feasibility", "param-noise",
                "real-model", "noise", "model", "anchors")
CITATION = re.compile(r"(?<![\w/.-])(?:docs/)?(" + "|".join(map(re.escape, DESIGN_NAMES)) + r")\.md\b")
SECTION = re.compile(r"§ ?(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#+ (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
BY_TITLE = re.compile(CITATION.pattern + r",? (?:\"|'|role \d)")
SCANNED = (".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".sh", "Dockerfile")


def _sections(name: str) -> set[str]:
    return set(HEADING.findall((DOCS / f"{name}.md").read_text()))


def _scanned_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in listed if p.endswith(SCANNED) and not p.startswith("benchmarks/results/")
            and (ROOT / p).is_file()]


def citations(text: str) -> list[tuple[int, str, str | None]]:
    """(line, document, section or None) for every citation in `text`, by the rule of the docstring."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        marks = sorted([(m.start(), "doc", m.group(1)) for m in CITATION.finditer(line)]
                       + [(m.start(), "sec", m.group(1)) for m in SECTION.finditer(line)])
        current, cited_alone = "algorithms", set()
        for _, kind, value in marks:
            if kind == "doc":
                current = value
                cited_alone.add(value)
            else:
                found.append((number, current, value))
                cited_alone.discard(current)
        found += [(number, name, None) for name in sorted(cited_alone)]
    return found


def test_the_rule_reads_files_and_sections_as_docs_readme_says():
    text = "see algorithms.md §1.2 and §3.7\n§0.5 alone\n(operations.md §3.4, §3.6; docs/style.md)\n"
    assert citations(text) == [(1, "algorithms", "1.2"), (1, "algorithms", "3.7"), (2, "algorithms", "0.5"),
                               (3, "operations", "3.4"), (3, "operations", "3.6"), (3, "style", None)]
    assert "1.6" in _sections("algorithms") and "4.1" in _sections("operations")


def test_every_citation_resolves():
    sections = {name: _sections(name) for name in DESIGN_NAMES if (DOCS / f"{name}.md").exists()}
    bad = []
    for path in _scanned_files():
        for line, name, section in citations(path.read_text(errors="replace")):
            where = f"{path.relative_to(ROOT)}:{line}"
            if name not in sections:
                bad.append(f"{where}: {name}.md is not in docs/")
            elif section is not None and section not in sections[name]:
                bad.append(f"{where}: {name}.md has no §{section}")
    assert not bad, "citations that do not resolve:\n" + "\n".join(bad)


def test_sections_are_cited_by_number():
    bad = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)}" for path in _scanned_files()
           for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
           for match in BY_TITLE.finditer(line)]
    assert not bad, "cite a section as §n.m:\n" + "\n".join(bad)


# a path of the repository named in code, tests or prose: after a file moves, every mention must follow it
REPO_PATH = re.compile(r"(?<![\w./-])((?:algorithms|services|deploy|tests|benchmarks|docs)/[\w/.-]*\w\.(?:py|md|toml|json|yaml))")
WRITTEN_BY_RUNS = "benchmarks/results/"  # outputs the benchmarks write when they run


def test_every_path_the_tree_names_exists():
    missing = [f"{path.relative_to(ROOT)}:{number}: {name}" for path in _scanned_files()
               for number, line in enumerate(path.read_text().splitlines(), 1)
               for name in REPO_PATH.findall(line)
               if not name.startswith(WRITTEN_BY_RUNS) and not (ROOT / name).exists()]
    assert not missing, "paths that name no file (moved or removed?):\n" + "\n".join(missing)


def test_the_path_rule_sees_a_moved_file():
    moved = "services" + "/sampler.py"  # where the sampler was before services/ had rooms (kept out of the scan)
    assert REPO_PATH.findall(f"see {moved} and (deploy/run.py)") == [moved, "deploy/run.py"]
    assert not (ROOT / moved).exists() and (ROOT / "deploy/run.py").exists()
