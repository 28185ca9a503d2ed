"""Torch's global state in tests: a fixed thread count per test, set when the test starts and restored after.

Importing a test module never changes torch's thread count; a module that wants a fixed count says
`pytestmark = pytest.mark.usefixtures("torch_threads")` (one thread) and a test that wants more adds
`@pytest.mark.threads(2)`. Loaded for every test by pyproject's `-p tests.fix_torch`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "threads(n): run the test on n torch threads (with the torch_threads fixture)")


@pytest.fixture
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test on one torch thread (or the `threads` marker's count) and restore the count afterwards."""
    import torch

    marker = request.node.get_closest_marker("threads")
    count = int(marker.args[0]) if marker else 1
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: more threads only spin (conftest.py)
        count = 1
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
