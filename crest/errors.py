"""Errors of the crest library and the exit code each class ends the command line with (never a traceback).

Exit codes: 0 success; 1 a failure that is neither bad input nor the database (no such store, a file that
cannot be written, a corrupt tree); 2 bad input or usage (an unknown option or command, a bad value, an
unreadable corpus, a tokenizer or model that cannot be loaded or does not fit the store); 3 the database (not
reachable, refused an operation, could not be migrated or started); 130 interrupted (Ctrl-C, SIGINT).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from crest_client.errors import (
    CodecError,
    ConnectionUnavailable,
    CrestClientError,
    FingerprintMismatch,
    InvalidDsn,
    InvalidName,
    StoreNotFound,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


class CrestError(CrestClientError):
    """Base class of crest's user-facing errors."""

    exit_code = EXIT_FAILURE


class CorpusError(CrestError):
    """A corpus input is missing, unreadable, malformed or empty."""

    exit_code = EXIT_USAGE


class TokenizerError(CrestError):
    """A tokenizer could not be loaded or does not fit the store."""

    exit_code = EXIT_USAGE


class ConfigError(CrestError):
    """An option or environment variable has an invalid value."""

    exit_code = EXIT_USAGE


class DatabaseError(CrestError):
    """The database could not be reached or refused an operation."""

    exit_code = EXIT_DATABASE


class ModelError(CrestError):
    """A model could not be loaded or is not supported by the verifier."""

    exit_code = EXIT_USAGE


# the SDK's errors carry no exit code (it is no command line); crest's are set on the classes above
_CLIENT_EXIT_CODES: dict[type[CrestClientError], int] = {
    ConnectionUnavailable: EXIT_DATABASE,
    FingerprintMismatch: EXIT_USAGE,
    InvalidDsn: EXIT_USAGE,
    InvalidName: EXIT_USAGE,
    StoreNotFound: EXIT_FAILURE,
    CodecError: EXIT_FAILURE,
}


def exit_code(error: CrestClientError) -> int:
    """Return the exit code the command line ends with for `error`."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, int):
        return code
    for cls in type(error).__mro__:
        if cls in _CLIENT_EXIT_CODES:
            return _CLIENT_EXIT_CODES[cls]
    return EXIT_FAILURE


@contextmanager
def errors_as_exit() -> Iterator[None]:
    """Turn a crest error into one `error:` line on stderr and crest's exit code (for `python -m` scripts)."""
    try:
        yield
    except CrestClientError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(exit_code(exc))


__all__ = [
    "EXIT_DATABASE",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_OK",
    "EXIT_USAGE",
    "CodecError",
    "ConfigError",
    "ConnectionUnavailable",
    "CorpusError",
    "CrestClientError",
    "CrestError",
    "DatabaseError",
    "FingerprintMismatch",
    "InvalidDsn",
    "InvalidName",
    "ModelError",
    "StoreNotFound",
    "TokenizerError",
    "errors_as_exit",
    "exit_code",
]
