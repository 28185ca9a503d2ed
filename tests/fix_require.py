"""Capability skips that CI turns into failures: `require(capability, reason)` skips the calling test (or module)
because something it needs is missing, unless `CREST_TESTS_REQUIRE` names that capability, when it fails instead.

`CREST_TESTS_REQUIRE` is a comma list of the capabilities in `CAPABILITIES` (spark: pyspark and a Java runtime;
replica: `pg_basebackup` beside the embedded PostgreSQL; psql: the `psql` client; vllm: a Python with vLLM's
engine, `CREST_VLLM_PYTHON`). A developer's laptop leaves it unset and sees the skips, with their reasons, in
`-ra`'s summary; `.ci/run` sets it, so a CI machine that lost Java fails loudly instead of passing with Spark
untested. Loaded as a plugin (`-p tests.fix_require`) so that a misspelt capability stops the run before any test.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

ENV = "CREST_TESTS_REQUIRE"
CAPABILITIES = frozenset({"spark", "replica", "psql", "vllm"})


def required() -> frozenset[str]:
    """Return the capabilities `CREST_TESTS_REQUIRE` names (a UsageError for a name not in CAPABILITIES)."""
    names = frozenset(n.strip().lower() for n in os.environ.get(ENV, "").split(",") if n.strip())
    unknown = sorted(names - CAPABILITIES)
    if unknown:
        raise pytest.UsageError(f"{ENV} names unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
    return names


def require(capability: str, reason: str) -> NoReturn:
    """Skip the test (or the module, at import) for want of `capability`, or fail when CI requires it."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")
    if capability in required():
        pytest.fail(f"{ENV} requires {capability}, but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set {ENV}={capability} to make this a failure)", allow_module_level=True)


def require_module(capability: str, module: str, reason: str) -> ModuleType:
    """Import and return `module`, or `require(capability, reason)` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        require(capability, f"{reason} ({error})")


def pytest_configure(config: pytest.Config) -> None:
    required()  # a misspelt capability stops the run here, before any test is collected
