"""Building a store version: its `building` row, stand-alone tables filled with COPY, and the atomic publish.

A build inserts a `building` row in `crest_stores`, holds a session advisory lock on it while it lives,
fills the stand-alone tables `crest_ngrams_s<ID>` / `crest_vocab_s<ID>` with COPY, indexes them, and then,
in one transaction, attaches them as partitions, retires the previous version and publishes the new one.
A store name has one published version per tier: `static` (built by ingest) and `live` (built from what it
learned, the `crest_learned` log); publishing retires only the same name and tier.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from crest_client.tiers import TIERS
from psycopg import sql

from crest.config import check_store_name, fault_pause
from crest.db._tables import LOCK_SPACE, drop_tables, name_lock, ngram_table, vocab_table
from crest.db.connection import connect
from crest.errors import ConfigError, DatabaseError

log = logging.getLogger(__name__)

# bytes of a version's token table and key filter (as stored, compressed or not); parameter: the store id
STORE_DATA_BYTES = (
    "(SELECT coalesce(sum(pg_column_size(token_table) + coalesce(pg_column_size(key_filter), 0)), 0)"
    " FROM crest_store_data WHERE store_id = %s)"
)


@dataclass
class Build:
    """A store version being built; its connection holds the liveness lock until `close()`."""

    conn: psycopg.Connection[Any]
    store_id: int
    name: str
    tier: str = "static"

    def copy_ngrams(self, rows: Iterable[tuple[bytes, int, int, bytes]]) -> int:
        """COPY (key, n, count, tree) rows into the version's table; return how many were written."""
        written = 0
        query = sql.SQL("COPY {} (store_id, count, n, key, tree) FROM STDIN (FORMAT BINARY)").format(
            ngram_table(self.store_id)
        )
        with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(query) as copy:
            copy.set_types(["int4", "int4", "int2", "bytea", "bytea"])
            sid = self.store_id
            for key, n, count, tree in rows:
                copy.write_row((sid, count, n, key, tree))
                written += 1
        return written

    def copy_vocab(self, pieces: Iterable[tuple[int, str]]) -> None:
        """COPY the (token id, text piece) rows of the tokenizer."""
        query = sql.SQL("COPY {} (store_id, token_id, piece) FROM STDIN (FORMAT BINARY)").format(
            vocab_table(self.store_id)
        )
        with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(query) as copy:
            copy.set_types(["int4", "int4", "text"])
            for token_id, piece in pieces:
                copy.write_row((self.store_id, token_id, piece.replace("\x00", "")))

    def write_store_data(self, token_table: bytes, key_filter: bytes | None) -> None:
        """Record the version's token table and key filter (read by clients once per version)."""
        with self.conn.transaction():
            self.conn.execute(
                "INSERT INTO crest_store_data (store_id, token_table, key_filter) VALUES (%s, %s, %s)"
                " ON CONFLICT (store_id) DO UPDATE SET token_table = EXCLUDED.token_table,"
                " key_filter = EXCLUDED.key_filter",
                (self.store_id, token_table, key_filter),
            )

    def finish_tables(self) -> None:
        """Index the loaded tables and add the constraints that make attaching them instant."""
        sid, ng, vt = self.store_id, ngram_table(self.store_id), vocab_table(self.store_id)
        self.conn.commit()
        self.conn.autocommit = True  # VACUUM runs outside a transaction
        try:  # drops the empty pages a bulk COPY extends the heap by (up to 18 of 72 seen); ANALYZE sizes the buckets
            self.conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(ng))
        finally:
            self.conn.autocommit = False
        with self.conn.transaction():
            self.conn.execute(
                sql.SQL("CREATE INDEX {} ON {} USING hash (key) WITH (fillfactor = 100)").format(
                    sql.Identifier(f"crest_ngrams_s{sid}_key"), ng
                )
            )
            fault_pause("index")  # the hash index is built, its transaction not committed
            self.conn.execute(
                sql.SQL("CREATE UNIQUE INDEX {} ON {} (store_id, token_id)").format(
                    sql.Identifier(f"crest_vocab_s{sid}_token"), vt
                )
            )
            for table in (ng, vt):
                self.conn.execute(
                    sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK (store_id = {})").format(
                        table,
                        sql.Identifier(f"{table.as_string(None).strip(chr(34))}_store"),
                        sql.Literal(sid),
                    )
                )

    def publish(self, figures: dict[str, Any]) -> None:
        """Attach the tables and make this version the published one, atomically."""
        sid = self.store_id
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_SPACE, name_lock(self.name)))
            for parent, table in (("crest_ngrams", ngram_table(sid)), ("crest_vocab", vocab_table(sid))):
                self.conn.execute(
                    sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})").format(
                        sql.Identifier(parent), table, sql.Literal(sid)
                    )
                )
            self.conn.execute(
                "UPDATE crest_stores SET state = 'retired' WHERE name = %s AND tier = %s AND state = 'published'",
                (self.name, self.tier),
            )
            fault_pause("publish")  # attached and the old version retired, not yet committed
            self.conn.execute(
                "UPDATE crest_stores SET state = 'published', published_at = now(), figures = %s WHERE id = %s",
                (json.dumps(figures), sid),
            )

    def set_figures(self, figures: dict[str, Any]) -> None:
        """Replace the figures recorded for this version."""
        with self.conn.transaction():
            self.conn.execute(
                "UPDATE crest_stores SET figures = %s WHERE id = %s", (json.dumps(figures), self.store_id)
            )

    def table_bytes(self) -> dict[str, int]:
        """Return the on-disk bytes of the n-gram table (plus the version's token table and key filter) and index."""
        row = self.conn.execute(
            "SELECT pg_table_size(%s::regclass) + " + STORE_DATA_BYTES + ", pg_indexes_size(%s::regclass)",
            (f"crest_ngrams_s{self.store_id}", self.store_id, f"crest_ngrams_s{self.store_id}"),
        ).fetchone()
        self.conn.commit()
        assert row is not None
        return {"table_bytes": int(row[0]), "index_bytes": int(row[1])}

    def fail(self) -> None:
        """Drop this version's tables and mark it failed (used when a build raises)."""
        try:
            self.conn.rollback()
            with self.conn.transaction():
                drop_tables(self.conn, self.store_id)
                self.conn.execute("UPDATE crest_stores SET state = 'failed' WHERE id = %s", (self.store_id,))
        except psycopg.Error as exc:
            log.warning("could not clean up failed build %s: %s", self.store_id, exc)

    def close(self) -> None:
        """Close the connection, releasing the liveness lock."""
        self.conn.close()


def begin_build(
    dsn: str,
    name: str,
    *,
    fingerprint: str,
    tokenizer: str,
    vocab_size: int,
    token_width: int,
    params: dict[str, Any],
    tier: str = "static",
) -> Build:
    """Register a new `building` version of store `name` (in `tier`) and create its stand-alone tables."""
    check_store_name(name)
    check_tier(tier)
    conn = connect(dsn)
    try:
        with conn.transaction():
            row = conn.execute(
                "INSERT INTO crest_stores (name, tier, state, tokenizer_fingerprint, tokenizer, vocab_size,"
                " token_width, params) VALUES (%s, %s, 'building', %s, %s, %s, %s, %s) RETURNING id",
                (name, tier, fingerprint, tokenizer, vocab_size, token_width, json.dumps(params)),
            ).fetchone()
            assert row is not None
            sid = int(row[0])
            conn.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_SPACE, sid))
            conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE crest_ngrams INCLUDING DEFAULTS) WITH (fillfactor = 100)").format(
                    ngram_table(sid)
                )
            )
            conn.execute(sql.SQL("CREATE TABLE {} (LIKE crest_vocab INCLUDING DEFAULTS)").format(vocab_table(sid)))
        return Build(conn, sid, name, tier)
    except psycopg.Error as exc:
        conn.close()
        raise DatabaseError(f"could not start building store {name!r}: {str(exc).strip()}") from None


def check_tier(tier: str) -> str:
    """Return `tier` when it is a store tier (static or live), else raise ConfigError."""
    if tier not in TIERS:
        raise ConfigError(f"unknown store tier {tier!r}: use {' or '.join(TIERS)}")
    return tier
