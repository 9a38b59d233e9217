"""deploy/docker/Dockerfile: its install steps are the commands CI and the README run, every image
runs as a non-root user, the engine images never pin the CPU torch, and the requirement script they
run gives threepo's dependencies without torch plus the engine extra's pins."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TARGETS = ("cpu", "vllm", "sglang")


def stages() -> dict[str, str]:
    """Stage name -> its instructions (continuation lines joined), comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    found: dict[str, list[str]] = {}
    current = None
    for line in lines:
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            found[current] = [line]
        elif current:
            found[current].append(line)
    return {name: "\n".join(body) for name, body in found.items()}


def test_targets_build_on_one_base():
    found = stages()
    assert set(TARGETS) | {"base", "gpu"} == set(found)
    assert re.match(r"FROM base AS", found["gpu"])
    for target in TARGETS:
        parent = "gpu" if target in ("vllm", "sglang") else "base"
        assert re.match(rf"FROM {parent} AS", found[target]), f"{target} must build on the shared base (one Python, one Ray)"
    assert list(found)[-1] == "cpu", "a plain `docker build` gives the CPU default"


def test_gpu_images_carry_a_compiler_and_deepspeed():
    """Triton compiles its launcher with the system C compiler at the first kernel launch; DeepSpeed
    is the learner's ZeRO path (learner.deepspeed_stage)."""
    gpu = stages()["gpu"]
    assert re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", gpu) and "DS_BUILD_OPS=0" in gpu
    for engine in ("vllm", "sglang"):
        assert "deepspeed" in stages()[engine] and "cc --version" in stages()[engine]


@pytest.mark.parametrize("target", TARGETS)
def test_every_image_runs_as_non_root(target):
    body = stages()["base"] + "\n" + stages()[target]
    users = re.findall(r"^USER\s+(\S+)", body, re.M)
    assert users, f"{target}: no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root") and uid.isdigit(), f"{target}: USER {users[-1]} (numeric, non-root)"
    assert re.search(rf"useradd --uid {uid}\b", stages()["base"]), "the USER is the one the base creates"
    last = [line for line in stages()[target].splitlines() if line.strip()][-1]
    assert last.startswith("USER"), f"{target}: USER must come after the install steps"


def test_cpu_image_installs_what_the_readme_installs():
    readme = (ROOT / "README.md").read_text()
    readme_install = re.search(r"pip install torch==\S+ -e \.(?= |$)", readme, re.M).group(0)
    assert readme_install.replace(" -e .", " .") in stages()["cpu"]
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert pin in readme_install, "README and pyproject pin the same torch"


def test_bubblewrap_installed_as_ci_installs_it():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"apt-get update -qq && apt-get install -y -qq bubblewrap", ci).group(0)
    assert command in stages()["base"], "the verifier/sandbox image installs bubblewrap like CI"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_images_leave_torch_to_the_engine(engine, tmp_path):
    body = stages()[engine]
    assert "torch==" not in body, f"{engine}: the engine pins its own CUDA torch"
    assert f"engine_requirements.py pyproject.toml {engine} deepspeed" in body and "pip install --no-deps ." in body
    script = re.search(r"COPY <<'PY' (\S+)\n(.*?)\nPY\n", DOCKERFILE, re.S)
    assert script and script.group(1) in body
    (tmp_path / "engine_requirements.py").write_text(script.group(2))
    out = subprocess.run([sys.executable, str(tmp_path / "engine_requirements.py"), str(ROOT / "pyproject.toml"),
                          engine, "deepspeed"], capture_output=True, text=True, check=True).stdout.split("\n")
    project = PYPROJECT["project"]
    expected = ([d for d in project["dependencies"] if not d.startswith("torch")] + project["optional-dependencies"][engine]
                + project["optional-dependencies"]["deepspeed"])
    assert [line for line in out if line] == expected
    assert any(line.startswith(f"{engine}==") for line in out)


def test_ray_pin_satisfies_pyproject():
    from packaging.requirements import Requirement

    pin = re.search(r"^ray==(\S+)$", (ROOT / "deploy" / "docker" / "constraints.txt").read_text(), re.M).group(1)
    ray = next(Requirement(d) for d in PYPROJECT["project"]["dependencies"] if Requirement(d).name == "ray")
    assert ray.specifier.contains(pin), f"constraints pin ray=={pin}, pyproject asks {ray}"
    assert "PIP_CONSTRAINT=/opt/threepo/constraints.txt" in stages()["base"]
