"""Store versions in PostgreSQL: listing them, dropping a store, and cleaning up what builds left behind.

A killed build leaves a `building` row whose lock nobody holds: `clean_leftovers` drops it, with retired and
failed versions. Building and publishing a version lives in `crest.db.build`, connections and migrations in
`crest.db.connection`; their names are handed on here, where callers have always found them. Every statement is
parameterised; table names are built from integer ids only and quoted with `sql.Identifier`.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg import sql

from crest.config import check_store_name, fault_pause
from crest.db._tables import LIVE_LOCK_SPACE, LOCK_SPACE, drop_tables, name_lock, ngram_table, vocab_table
from crest.db.build import STORE_DATA_BYTES, TIERS, Build, begin_build, check_tier
from crest.db.connection import MIGRATIONS, connect, session, upgrade
from crest.errors import StoreNotFound

__all__ = [
    "LEARNED_FIGURES",
    "LIVE_LOCK_SPACE",
    "MIGRATIONS",
    "STORE_DATA_BYTES",
    "TIERS",
    "Build",
    "begin_build",
    "check_tier",
    "clean_leftovers",
    "connect",
    "drop_store",
    "list_stores",
    "ngram_table",
    "refresh_lock_key",
    "session",
    "upgrade",
    "vocab_table",
]

log = logging.getLogger(__name__)

# on-disk bytes of each store's learned rows: its share (by row size) of crest_learned with its index and TOAST
LEARNED_FIGURES = (
    "SELECT l.store, count(*) AS rows, sum(l.n_tokens)::bigint AS tokens,"
    " (pg_total_relation_size('crest_learned') * sum(pg_column_size(l.*))"
    " / nullif(sum(sum(pg_column_size(l.*))) OVER (), 0))::bigint AS bytes"
    " FROM crest_learned AS l GROUP BY l.store"
)


def clean_leftovers(
    conn: psycopg.Connection[Any], *, name: str | None = None, tier: str | None = None, lock_timeout_ms: int = 2000
) -> list[int]:
    """Drop retired and failed versions and builds whose process died (of `name` / `tier` when given); return ids."""
    removed: list[int] = []
    was_autocommit = conn.autocommit
    conn.autocommit = True
    try:
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{int(lock_timeout_ms)}ms")))
        rows = conn.execute(
            "SELECT id, state FROM crest_stores WHERE state <> 'published'"
            " AND (%(name)s::text IS NULL OR name = %(name)s) AND (%(tier)s::text IS NULL OR tier = %(tier)s)"
            " ORDER BY id",
            {"name": name, "tier": tier},
        ).fetchall()
        for sid, state in rows:
            if state == "building":
                got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (LOCK_SPACE, sid)).fetchone()
                if not (got and got[0]):
                    continue  # its builder is alive
                now = conn.execute("SELECT state FROM crest_stores WHERE id = %s", (sid,)).fetchone()
                if now is None or now[0] == "published":  # its builder published and ended since the SELECT above
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_SPACE, sid))
                    continue
            try:
                _detach(conn, sid)
                fault_pause("clean")  # detached (when it was attached), its tables not yet dropped
                with conn.transaction():
                    drop_tables(conn, sid)
                    conn.execute("DELETE FROM crest_stores WHERE id = %s", (sid,))
                removed.append(int(sid))
            except psycopg.Error as exc:
                log.warning("left store version %s for a later clean-up: %s", sid, str(exc).strip())
            finally:
                if state == "building":
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_SPACE, sid))
        conn.execute("RESET lock_timeout")
    finally:
        conn.autocommit = was_autocommit
    return removed


def _detach(conn: psycopg.Connection[Any], sid: int) -> None:
    """Detach a version's partitions without blocking readers (autocommit connection)."""
    for parent, table in (("crest_ngrams", f"crest_ngrams_s{sid}"), ("crest_vocab", f"crest_vocab_s{sid}")):
        row = conn.execute(
            "SELECT i.inhdetachpending FROM pg_inherits i WHERE i.inhrelid = to_regclass(%s)"
            " AND i.inhparent = %s::regclass",
            (table, parent),
        ).fetchone()
        if row is None:
            continue
        clause = "FINALIZE" if row[0] else "CONCURRENTLY"
        conn.execute(
            sql.SQL("ALTER TABLE {} DETACH PARTITION {} " + clause).format(
                sql.Identifier(parent), sql.Identifier(table)
            )
        )


def list_stores(conn: psycopg.Connection[Any], *, include_all: bool = False) -> list[dict[str, Any]]:
    """Return the store versions (published ones unless `include_all`) with figures, disk use and learned rows."""
    where = "" if include_all else "WHERE s.state = 'published'"
    rows = conn.execute(
        "SELECT s.id, s.name, s.state, s.tokenizer, s.tokenizer_fingerprint, s.vocab_size, s.params, s.figures,"
        " s.created_at, s.published_at, s.tier,"
        " coalesce(l.rows, 0), coalesce(l.tokens, 0), coalesce(l.bytes, 0),"
        " coalesce(pg_table_size(to_regclass('crest_ngrams_s' || s.id)), 0)"
        " + (SELECT coalesce(sum(pg_column_size(d.token_table) + coalesce(pg_column_size(d.key_filter), 0)), 0)"
        " FROM crest_store_data d WHERE d.store_id = s.id),"
        " coalesce(pg_indexes_size(to_regclass('crest_ngrams_s' || s.id)), 0)"
        f" FROM crest_stores s LEFT JOIN ({LEARNED_FIGURES}) AS l ON l.store = s.name {where}"
        " ORDER BY s.name, s.tier DESC, s.id"
    ).fetchall()
    keys = [
        "id",
        "name",
        "state",
        "tokenizer",
        "fingerprint",
        "vocab_size",
        "params",
        "figures",
        "created_at",
        "published_at",
        "tier",
        "learned_rows",
        "learned_tokens",
        "learned_bytes",
        "table_bytes",
        "index_bytes",
    ]
    return [dict(zip(keys, row, strict=False)) for row in rows]


def drop_store(conn: psycopg.Connection[Any], name: str) -> int:
    """Retire and drop the published versions of `name` (both tiers) and its learned rows; return the static id."""
    check_store_name(name)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LIVE_LOCK_SPACE, name_lock(name)))  # no refresh now
        rows = conn.execute(
            "UPDATE crest_stores SET state = 'retired' WHERE name = %s AND state = 'published' RETURNING id, tier",
            (name,),
        ).fetchall()
        if not any(tier == "static" for _, tier in rows):
            raise StoreNotFound(f"no published store named {name!r}")
        conn.execute("DELETE FROM crest_learned WHERE store = %s", (name,))
    clean_leftovers(conn, name=name)
    return next(int(sid) for sid, tier in rows if tier == "static")


def refresh_lock_key(name: str) -> tuple[int, int]:
    """Return the advisory lock (class, object) that one store's live refreshes and forgets hold."""
    return LIVE_LOCK_SPACE, name_lock(name)
