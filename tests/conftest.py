"""Test-wide settings: a private CREST_HOME so tests never touch the user's data or embedded server, removed at the
end, and hypothesis profiles.

Hypothesis profiles: `ci` (loaded when `CI` is set) derandomizes every property test (the examples follow from
the test's name, so a CI failure happens again on any machine) and prints the blob that replays a failing
example (`@reproduce_failure`); `dev` (the default) draws fresh examples each run and prints that blob too.
`CREST_HYPOTHESIS_PROFILE=ci|dev` picks one explicitly. To replay a failure from CI, run the test locally with
`CREST_HYPOTHESIS_PROFILE=ci` or paste the printed `@reproduce_failure(...)` decorator onto the test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

_HOME = Path(tempfile.mkdtemp(prefix="crest-tests-home-"))

settings.register_profile("ci", derandomize=True, print_blob=True, database=None, deadline=None)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("CREST_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config: pytest.Config) -> None:
    os.environ["CREST_HOME"] = str(_HOME)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # several workers on few cores: OpenMP threads that spin-wait for each other slow a real-model test
        # tenfold under load (one ran past the 600 s timeout); one thread per worker and per subprocess it starts
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    from crest_client.embedded import stop_embedded

    try:
        stop_embedded(_HOME)
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)
