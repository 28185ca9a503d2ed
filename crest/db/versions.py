"""Everything crest says to PostgreSQL: migrations, building and atomically publishing store versions.

A build inserts a `building` row in `crest_stores`, holds a session advisory lock on it while it lives,
fills the stand-alone tables `crest_ngrams_s<ID>` / `crest_vocab_s<ID>` with COPY, indexes them, and then,
in one transaction, attaches them as partitions, retires the previous version and publishes the new one.
A killed build leaves a `building` row whose lock nobody holds: `clean_leftovers` drops it. A store name
has one published version per tier: `static` (built by ingest) and `live` (built from what it learned, the
`crest_learned` log); publishing retires only the same name and tier. Every statement is parameterised;
table names are built from integer ids only and quoted with `sql.Identifier`.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from crest.config import check_store_name, fault_pause
from crest.errors import ConfigError, DatabaseError, StoreNotFound

log = logging.getLogger(__name__)

MIGRATIONS = "crest.migrations"  # the top-level migrations/ folder, mapped into the package
# bytes of a version's token table and key filter (as stored, compressed or not); parameter: the store id
STORE_DATA_BYTES = (
    "(SELECT coalesce(sum(pg_column_size(token_table) + coalesce(pg_column_size(key_filter), 0)), 0)"
    " FROM crest_store_data WHERE store_id = %s)"
)
TIERS = ("static", "live")
# on-disk bytes of each store's learned rows: its share (by row size) of crest_learned with its index and TOAST
LEARNED_FIGURES = (
    "SELECT l.store, count(*) AS rows, sum(l.n_tokens)::bigint AS tokens,"
    " (pg_total_relation_size('crest_learned') * sum(pg_column_size(l.*))"
    " / nullif(sum(sum(pg_column_size(l.*))) OVER (), 0))::bigint AS bytes"
    " FROM crest_learned AS l GROUP BY l.store"
)
_LOCK_SPACE = 0x4352  # advisory lock class id: "CR"
_MIGRATE_LOCK = 0x4352_0001
LIVE_LOCK_SPACE = 0x4C56  # advisory lock class id of a store's refresh / forget: "LV"


def connect(dsn: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """Open a connection, turning failures into a DatabaseError that names the server."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10, application_name="crest")
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot connect to the database ({_safe_dsn(dsn)}): {exc}".strip()) from None


@contextmanager
def session(dsn: str, *, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
    """Yield a connection that is closed afterwards; database errors become DatabaseError."""
    conn = connect(dsn, autocommit=autocommit)
    try:
        yield conn
    except psycopg.Error as exc:
        raise DatabaseError(f"database error: {str(exc).strip()}") from None
    finally:
        conn.close()


def upgrade(dsn: str, *, revision: str = "head") -> str | None:
    """Run the Alembic migrations up to `revision`; return the revision now current."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine("postgresql+psycopg://", creator=lambda: connect(dsn), poolclass=NullPool)
    config = Config()
    try:
        config.set_main_option("script_location", str(resources.files(MIGRATIONS)))
        with engine.begin() as connection:
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATE_LOCK})")
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
            context = MigrationContext.configure(connection, opts={"version_table": "crest_alembic_version"})
            return context.get_current_revision()
    except DatabaseError:
        raise
    except Exception as exc:
        raise DatabaseError(f"could not migrate the database schema: {exc}") from None
    finally:
        engine.dispose()


def ngram_table(store_id: int) -> sql.Identifier:
    """Return the identifier of a store version's n-gram partition."""
    return sql.Identifier(f"crest_ngrams_s{int(store_id)}")


def vocab_table(store_id: int) -> sql.Identifier:
    """Return the identifier of a store version's vocabulary partition."""
    return sql.Identifier(f"crest_vocab_s{int(store_id)}")


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
        self.conn.execute(sql.SQL("ANALYZE {}").format(ng))  # sizes the hash index's buckets right
        self.conn.commit()
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
            self.conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_SPACE, _name_lock(self.name)))
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
                _drop_tables(self.conn, self.store_id)
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
            conn.execute("SELECT pg_advisory_lock(%s, %s)", (_LOCK_SPACE, sid))
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
                got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (_LOCK_SPACE, sid)).fetchone()
                if not (got and got[0]):
                    continue  # its builder is alive
                now = conn.execute("SELECT state FROM crest_stores WHERE id = %s", (sid,)).fetchone()
                if now is None or now[0] == "published":  # its builder published and ended since the SELECT above
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (_LOCK_SPACE, sid))
                    continue
            try:
                _detach(conn, sid)
                fault_pause("clean")  # detached (when it was attached), its tables not yet dropped
                with conn.transaction():
                    _drop_tables(conn, sid)
                    conn.execute("DELETE FROM crest_stores WHERE id = %s", (sid,))
                removed.append(int(sid))
            except psycopg.Error as exc:
                log.warning("left store version %s for a later clean-up: %s", sid, str(exc).strip())
            finally:
                if state == "building":
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (_LOCK_SPACE, sid))
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


def _drop_tables(conn: psycopg.Connection[Any], sid: int) -> None:
    conn.execute("DELETE FROM crest_store_data WHERE store_id = %s", (sid,))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ngram_table(sid)))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(vocab_table(sid)))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(f"crest_dense_s{int(sid)}")))  # dense part


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
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LIVE_LOCK_SPACE, _name_lock(name)))  # no refresh now
        rows = conn.execute(
            "UPDATE crest_stores SET state = 'retired' WHERE name = %s AND state = 'published' RETURNING id, tier",
            (name,),
        ).fetchall()
        if not any(tier == "static" for _, tier in rows):
            raise StoreNotFound(f"no published store named {name!r}")
        conn.execute("DELETE FROM crest_learned WHERE store = %s", (name,))
    clean_leftovers(conn, name=name)
    return next(int(sid) for sid, tier in rows if tier == "static")


def _name_lock(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def refresh_lock_key(name: str) -> tuple[int, int]:
    """Return the advisory lock (class, object) that one store's live refreshes and forgets hold."""
    return LIVE_LOCK_SPACE, _name_lock(name)


def _safe_dsn(dsn: str) -> str:
    """Return the DSN with any password masked, for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<unparsable DSN>"
    if info.get("password"):
        info["password"] = "***"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
