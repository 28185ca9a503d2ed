"""Errors raised by the crest client SDK; every one carries a message fit to show a user."""

from __future__ import annotations


class CrestClientError(Exception):
    """Base class of the SDK's errors: its message is one line (a database's reason on several is joined)."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (" ".join(args[0].split()),)  # libpq's "LINE 1: ..." and "\tIs the server running" lines
        super().__init__(*args)


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
