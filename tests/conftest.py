"""Test-wide settings: a private CREST_HOME so tests never touch the user's data or embedded server."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="crest-tests-home-"))


def pytest_configure(config: pytest.Config) -> None:
    os.environ["CREST_HOME"] = str(_HOME)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_unconfigure(config: pytest.Config) -> None:
    from crest_client.embedded import stop_embedded

    stop_embedded(_HOME)
