"""A store version's tables and advisory locks: the names and rules that building and cleaning up share.

Table names are built from integer ids only and quoted with `sql.Identifier`. A build holds a session lock in
`LOCK_SPACE` on its version id while it lives and a transaction lock on its store name while it publishes;
refreshes and forgets of one store take `LIVE_LOCK_SPACE` on its name.
"""

from __future__ import annotations

import zlib
from typing import Any

import psycopg
from psycopg import sql

LOCK_SPACE = 0x4352  # advisory lock class id: "CR"
LIVE_LOCK_SPACE = 0x4C56  # advisory lock class id of a store's refresh / forget: "LV"


def ngram_table(store_id: int) -> sql.Identifier:
    """Return the identifier of a store version's n-gram partition."""
    return sql.Identifier(f"crest_ngrams_s{int(store_id)}")


def vocab_table(store_id: int) -> sql.Identifier:
    """Return the identifier of a store version's vocabulary partition."""
    return sql.Identifier(f"crest_vocab_s{int(store_id)}")


def drop_tables(conn: psycopg.Connection[Any], sid: int) -> None:
    """Drop a version's tables and its token table and key filter (in the caller's transaction)."""
    conn.execute("DELETE FROM crest_store_data WHERE store_id = %s", (sid,))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ngram_table(sid)))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(vocab_table(sid)))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(f"crest_dense_s{int(sid)}")))  # dense part


def name_lock(name: str) -> int:
    """Return the advisory lock object id of a store name."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
