"""What a client reads about a store once per version: `StoreInfo`, its token table and key filter.

A store name has one published static version (built by `crest ingest`) and at most one published live
version (built from what the store learned from served requests, `crest refresh`); both are rows of
`crest_stores` told apart by `tier`. `read_info` reads one tier's published version; the token table that tree
blobs' ranks index and the filter of stored keys are read once per version (a version's data never changes),
so re-reading a version the caller already knows costs one small query. `read_live` reads the live tier when
it was built with the static tier's tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from crest_client.codec import TokenTable
from crest_client.errors import CodecError, ConnectionUnavailable, StoreNotFound
from crest_client.keyfilter import KeyFilter

log = logging.getLogger(__name__)

DATA_SQL = "SELECT token_table, key_filter FROM crest_store_data WHERE store_id = %s"
INFO_SQL = (
    "SELECT id, tokenizer_fingerprint, vocab_size, token_width, params, tokenizer FROM crest_stores"
    " WHERE name = %s AND tier = %s AND state = 'published'"
)
PUBLISHED_SQL = b"SELECT tier, id FROM crest_stores WHERE name = $1 AND state = 'published'"

Connection = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


@dataclass(frozen=True)
class StoreInfo:
    """What a client needs to know about the published version of a store."""

    id: int
    name: str
    fingerprint: str
    vocab_size: int
    token_width: int
    max_n: int
    params: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
    table: TokenTable | None = field(default=None, repr=False, compare=False)  # blobs' token ranks -> ids
    key_filter: KeyFilter | None = field(default=None, repr=False, compare=False)  # None: probe every n
    tier: str = "static"


def read_info(
    connection: Connection,
    name: str,
    *,
    tier: str = "static",
    known: StoreInfo | None = None,
    data_timeout: float = 10.0,
    info_timeout: float | None = None,
) -> StoreInfo:
    """Return the published version of one tier of store `name`; raise StoreNotFound when there is none.

    The catalog row is read within `info_timeout` seconds (None: the connection's statement timeout, a lookup's),
    the version's data within `data_timeout`.
    """
    try:
        with connection() as conn, bounded(conn, info_timeout):
            row = conn.execute(INFO_SQL, (name, tier)).fetchone()
    except (psycopg.Error, PoolTimeout) as exc:
        raise ConnectionUnavailable(f"cannot read store {name!r}: {exc}") from None
    if row is None:
        what = "store" if tier == "static" else f"{tier} tier of store"
        raise StoreNotFound(f"no published {what} named {name!r}")
    sid, fingerprint, vocab_size, width, params, tokenizer = row
    if known is not None and known.id == int(sid):
        table, key_filter = known.table, known.key_filter  # same version: its data never changes
    else:
        table, key_filter = read_data(connection, name, int(sid), int(vocab_size), timeout=data_timeout)
    return StoreInfo(
        id=int(sid),
        name=name,
        fingerprint=fingerprint,
        vocab_size=int(vocab_size),
        token_width=int(width),
        max_n=int((params or {}).get("max_n", 4)),
        params=dict(params or {}),
        tokenizer=str(tokenizer or ""),
        table=table,
        key_filter=key_filter,
        tier=tier,
    )


def read_data(
    connection: Connection,
    name: str,
    store_id: int,
    vocab: int,
    *,
    timeout: float,
) -> tuple[TokenTable | None, KeyFilter | None]:
    """Read a version's token table and key filter (None, None for stores older than them)."""
    try:
        with connection() as conn, bounded(conn, timeout):
            row = conn.execute(DATA_SQL, (store_id,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return None, None
    except (psycopg.Error, PoolTimeout) as exc:
        raise ConnectionUnavailable(f"cannot read store {name!r}: {exc}") from None
    if row is None:
        return None, None
    try:
        table = TokenTable.from_bytes(row[0])
        if len(table) and int(table.tokens.max()) >= vocab:
            raise CodecError(f"a token id is outside the vocabulary of {vocab}")
        return table, KeyFilter.from_bytes(row[1]) if row[1] is not None else None
    except CodecError as exc:
        raise CodecError(f"store {name!r} has a corrupt token table or key filter: {exc}") from None


def read_live(
    connection: Connection, name: str, static: StoreInfo, *, data_timeout: float, info_timeout: float | None = None
) -> StoreInfo | None:
    """Return the store's published live tier when it has one built with the static tier's tokenizer."""
    try:
        live = read_info(connection, name, tier="live", data_timeout=data_timeout, info_timeout=info_timeout)
    except StoreNotFound:
        return None
    same = (live.fingerprint, live.vocab_size, live.token_width) == (
        static.fingerprint,
        static.vocab_size,
        static.token_width,
    )
    if not same:
        log.warning("store %r: its live tier was built with another tokenizer; ignored", name)
        return None
    return live


@contextmanager
def bounded(conn: psycopg.Connection[Any], timeout: float | None) -> Iterator[None]:
    """Run the body's statements within `timeout` seconds (a transaction: SET LOCAL ends with it); None: as set."""
    if timeout is None:
        yield
        return
    with conn.transaction():
        conn.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout * 1000))}")
        yield
