"""crest_client: the light SDK of crest (psycopg, lz4 and numpy only, no torch).

`Store.connect(...)` opens a pooled connection to a crest store; `store.draft(context_ids)` finds the
longest stored suffix of the context in one round trip and returns its token tree as a `Draft`.
"""

from crest_client.draft import Draft, empty_draft
from crest_client.errors import (
    CodecError,
    ConnectionUnavailable,
    CrestClientError,
    FingerprintMismatch,
    InvalidName,
    StoreNotFound,
)
from crest_client.store import Store, StoreInfo

__all__ = [
    "CodecError",
    "ConnectionUnavailable",
    "CrestClientError",
    "Draft",
    "FingerprintMismatch",
    "InvalidName",
    "Store",
    "StoreInfo",
    "StoreNotFound",
    "empty_draft",
]
