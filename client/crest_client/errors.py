"""Errors raised by the crest client SDK; every one carries a message fit to show a user."""

from __future__ import annotations


class CrestClientError(Exception):
    """Base class of the SDK's errors."""


class CodecError(CrestClientError):
    """A tree blob could not be decoded (malformed, truncated or of an unknown version)."""


class StoreNotFound(CrestClientError):
    """No published store has the requested name."""


class FingerprintMismatch(CrestClientError):
    """The store was built with another tokenizer than the caller's."""


class ConnectionUnavailable(CrestClientError):
    """No database could be reached or started."""


class InvalidName(CrestClientError):
    """A store name is not a plain identifier."""


class InvalidDsn(CrestClientError):
    """A DSN cannot be parsed, or names hosts and ports that do not match."""
