"""crest_client: the light SDK of crest (psycopg, lz4 and numpy only, no torch).

`Store.connect(...)` opens a pooled connection to a crest store; `store.draft(context_ids)` finds the
longest stored suffix of the context in one round trip and returns its token tree as a `Draft`.
"""

from typing import TYPE_CHECKING

from crest_client.draft import Draft, empty_draft
from crest_client.errors import (
    CodecError,
    ConnectionUnavailable,
    CrestClientError,
    FingerprintMismatch,
    InvalidDsn,
    InvalidName,
    StoreNotFound,
)

if TYPE_CHECKING:
    from crest_client.learner import Learner
    from crest_client.store import Store, StoreInfo


def __getattr__(name: str) -> object:
    """Import the database-backed parts lazily, so `crest_client.draft` needs no psycopg."""
    if name in ("Store", "StoreInfo"):
        from crest_client import store

        return getattr(store, name)
    if name == "Learner":
        from crest_client import learner

        return learner.Learner
    raise AttributeError(name)


__all__ = [
    "CodecError",
    "ConnectionUnavailable",
    "CrestClientError",
    "Draft",
    "FingerprintMismatch",
    "InvalidDsn",
    "InvalidName",
    "Learner",
    "Store",
    "StoreInfo",
    "StoreNotFound",
    "empty_draft",
]
