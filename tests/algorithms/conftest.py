"""The algorithms tier must not need Ray, transformers or vLLM: make an accidental import fail loudly
while these tests run (tests/test_structure.py checks the same in a clean subprocess)."""

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_heavy_imports(monkeypatch):
    for name in ("ray", "vllm", "sglang"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, None)
    yield
