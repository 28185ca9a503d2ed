"""Waiting on a condition with a deadline (never a bare sleep): tests pass on a loaded machine, or say what never
happened."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], what: str, *, timeout: float = 60.0) -> None:
    """Return once `condition()` holds; fail with `what` when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling a condition under a deadline
