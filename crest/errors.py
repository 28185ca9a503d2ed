"""Errors of the crest library; the CLI prints their message and exits non-zero, never a traceback."""

from __future__ import annotations

from crest_client.errors import CodecError, CrestClientError, FingerprintMismatch, InvalidName, StoreNotFound


class CrestError(CrestClientError):
    """Base class of crest's user-facing errors."""

    exit_code = 1


class CorpusError(CrestError):
    """A corpus input is missing, unreadable, malformed or empty."""

    exit_code = 2


class TokenizerError(CrestError):
    """A tokenizer could not be loaded or does not fit the store."""

    exit_code = 2


class ConfigError(CrestError):
    """An option or environment variable has an invalid value."""

    exit_code = 2


class DatabaseError(CrestError):
    """The database could not be reached or refused an operation."""

    exit_code = 3


class ModelError(CrestError):
    """A model could not be loaded or is not supported by the verifier."""

    exit_code = 2


__all__ = [
    "CodecError",
    "ConfigError",
    "CorpusError",
    "CrestClientError",
    "CrestError",
    "DatabaseError",
    "FingerprintMismatch",
    "InvalidName",
    "ModelError",
    "StoreNotFound",
    "TokenizerError",
]
