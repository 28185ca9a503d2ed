"""`Store`: the SDK's handle on one published crest store.

`draft(context_ids)` hashes every suffix of the context up to the store's max n, keeps those that the
version's key filter may hold (a Bloom filter loaded once per version; it never drops a stored key) and asks
PostgreSQL for the longest one that is stored, in one prepared statement: a UNION ALL of single-key probes of
the published version's partition, longest first, under LIMIT 1, so the server stops at the first hit (each
probe is an O(1) hash-index scan). A context none of whose suffixes passes the filter costs no round trip.
The tree blob is decoded into a `Draft` with the version's token table. The handle re-reads which version
is published every `refresh_interval` seconds and whenever its partition is gone, so readers move to a new
version once it is published, and never see a mix of two. Results are kept in a bounded LRU cache keyed by the
last max-n tokens. Connections come from a psycopg pool, so one `Store` is safe to share between threads.
Failures of the database (down, slow, restarting) and corrupt rows make `draft()` return None: generation goes
on.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool, PoolTimeout

from crest_client.codec import TokenTable, decode_tree
from crest_client.draft import Draft
from crest_client.errors import (
    CodecError,
    ConnectionUnavailable,
    FingerprintMismatch,
    StoreNotFound,
)
from crest_client.keyfilter import KeyFilter, suffix_hashes
from crest_client.names import check_store_name, resolve_dsn

log = logging.getLogger(__name__)

POOL_PREFIX = "crest-client-"  # the names of the SDK's pools, whose failures `Store` reports itself, once

DATA_SQL = "SELECT token_table, key_filter FROM crest_store_data WHERE store_id = %s"
INFO_SQL = (
    "SELECT id, tokenizer_fingerprint, vocab_size, token_width, params, tokenizer FROM crest_stores"
    " WHERE name = %s AND state = 'published'"
)


def lookup_sql(store_id: int, probes: int) -> str:
    """Return the one-round-trip lookup of `probes` keys of a store version, longest first: first hit wins."""
    probe = f"(SELECT n, tree FROM crest_ngrams_s{int(store_id)} WHERE key = %s)"
    return " UNION ALL ".join([probe] * probes) + " LIMIT 1"


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


class Store:
    """A pooled, cached reader of one crest store."""

    def __init__(
        self,
        pool: ConnectionPool,
        info: StoreInfo,
        *,
        tokenizer_fingerprint: str | None = None,
        cache_size: int = 4096,
        timeout: float = 0.01,
        refresh_interval: float = 1.0,
    ) -> None:
        self._pool = pool
        self.info = info
        self.name = info.name
        self._fingerprint = tokenizer_fingerprint
        self._cache_size = max(0, int(cache_size))
        self._cache: OrderedDict[tuple[int, ...], Draft | None] = OrderedDict()
        self._lock = threading.Lock()
        self._idle: list[psycopg.Connection[Any]] = []  # connections kept out of the pool for lookups
        self._out = 0  # connections taken from the pool: idle or in use
        self._kept = threading.Condition(threading.Lock())
        self._prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()
        self._timeout = float(timeout)
        self._refresh_interval = float(refresh_interval)
        self._checked = time.monotonic()
        self._set_info(info)
        self._warned: set[str] = set()
        self.stats = {"lookups": 0, "hits": 0, "errors": 0, "queries": 0}

    @classmethod
    def connect(
        cls,
        dsn: str | None = None,
        name: str = "default",
        *,
        tokenizer_fingerprint: str | None = None,
        cache_size: int = 4096,
        timeout: float = 0.01,
        refresh_interval: float = 1.0,
        pool_size: int = 4,
        connect_timeout: float = 10.0,
    ) -> Store:
        """Connect to the published store `name` (DSN: argument, else CREST_DATABASE_URL, else embedded)."""
        check_store_name(name)
        dsn = resolve_dsn(dsn)
        try:  # one plain attempt first: a down database fails at once, with its reason, and no pool retries
            psycopg.connect(dsn, connect_timeout=max(2, math.ceil(connect_timeout))).close()
        except psycopg.Error as exc:
            reason = " ".join(str(exc).split())
            raise ConnectionUnavailable(f"cannot connect to the crest database for store {name!r}: {reason}") from None
        timeout_ms = max(1, int(timeout * 1000))

        def configure(conn: psycopg.Connection[Any]) -> None:
            conn.execute(f"SET statement_timeout = {timeout_ms}")
            conn.commit()

        pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max(1, pool_size),
            open=False,
            configure=configure,
            kwargs={"autocommit": True, "prepare_threshold": 0, "application_name": "crest-client"},
            timeout=connect_timeout,
            reconnect_timeout=0,
            name=f"{POOL_PREFIX}{name}",
        )
        try:
            pool.open(wait=True, timeout=connect_timeout)
        except PoolTimeout:
            pool.close()
            raise ConnectionUnavailable(f"cannot connect to the crest database for store {name!r}") from None
        try:
            info = _read_info(pool.connection, name, data_timeout=connect_timeout)
        except BaseException:
            pool.close()
            raise
        if tokenizer_fingerprint is not None and tokenizer_fingerprint != info.fingerprint:
            pool.close()
            raise FingerprintMismatch(
                f"store {name!r} was built with another tokenizer (fingerprint {info.fingerprint[:12]}...) "
                f"than yours ({tokenizer_fingerprint[:12]}...)"
            )
        return cls(
            pool,
            info,
            tokenizer_fingerprint=tokenizer_fingerprint,
            cache_size=cache_size,
            timeout=timeout,
            refresh_interval=refresh_interval,
        )

    def keys(self, context_ids: Sequence[int] | np.ndarray) -> list[bytes | None]:
        """Return the keys of the context's suffixes, longest (max n) first; None where too short."""
        info = self.info
        tail = [int(t) for t in context_ids[-info.max_n :]]
        if any(t < 0 or t >= info.vocab_size for t in tail):
            return []
        w = info.token_width
        raw = b"".join(t.to_bytes(w, "big") for t in tail)
        return [raw[len(raw) - k * w :] if k <= len(tail) else None for k in range(info.max_n, 0, -1)]

    def candidate_keys(self, tail: Sequence[int]) -> list[bytes]:
        """Return the keys of the tail's suffixes that may be stored (all, without a filter), longest first."""
        found = self.info.key_filter
        keys = self.keys(tail)  # longest first; [] when a token is outside the vocabulary
        if found is None or not keys:
            return [k for k in keys if k is not None]
        hashes = suffix_hashes(tail[-self.info.max_n :])  # item k - 1 hashes the last k tokens
        return [key for key in keys if key is not None and hashes[len(key) // self.info.token_width - 1] in found]

    def draft(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int = 64) -> Draft | None:
        """Return the tree of the longest stored suffix of the context, or None."""
        tail = tuple(int(t) for t in context_ids[-self.info.max_n :])
        if not tail:
            return None
        self.stats["lookups"] += 1
        if self._cache_size:
            with self._lock:
                found = self._cache.get(tail, _MISSING)
                if found is not _MISSING:
                    self._cache.move_to_end(tail)
                    self.stats["hits"] += 1
                    return found.truncate(max_nodes) if found is not None else None
        result = self._lookup(tail)
        if result is _FAILED:
            return None
        if self._cache_size:
            with self._lock:
                self._cache[tail] = result
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return result.truncate(max_nodes) if result is not None else None

    def draft_many(self, contexts: Sequence[Sequence[int] | np.ndarray], max_nodes: int = 64) -> list[Draft | None]:
        """Return drafts for many contexts, sending all lookups in one pipeline."""
        out: list[Draft | None] = [None] * len(contexts)
        todo: list[tuple[int, tuple[int, ...]]] = []
        for i, ctx in enumerate(contexts):
            tail = tuple(int(t) for t in ctx[-self.info.max_n :])
            cached = self._cache.get(tail, _MISSING) if self._cache_size else _MISSING
            if cached is _MISSING:
                if tail:
                    todo.append((i, tail))
            elif cached is not None:
                out[i] = cached.truncate(max_nodes)
        if not todo:
            return out
        try:
            with self._connection() as conn, conn.pipeline():
                cursors = []
                for _, tail in todo:
                    keys = self.candidate_keys(tail)
                    cursors.append(
                        conn.execute(self._sql[len(keys)], keys, prepare=True, binary=True) if keys else None
                    )
                rows = [cur.fetchone() if cur is not None else None for cur in cursors]
        except psycopg.errors.UndefinedTable:
            self._switch_version()
            return out
        except (psycopg.Error, PoolTimeout) as exc:
            self._note_failure(exc)
            return out
        for (i, tail), row in zip(todo, rows, strict=True):
            draft = self._to_draft(row)
            if self._cache_size:
                with self._lock:
                    self._cache[tail] = draft
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            out[i] = draft.truncate(max_nodes) if draft is not None else None
        return out

    def clear_cache(self) -> None:
        """Forget every cached draft."""
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        """Close the pool."""
        with self._kept:
            idle, self._idle = self._idle, []
            self._out -= len(idle)
        for conn in idle:
            self._pool.putconn(conn)
        self._pool.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lookup(self, tail: tuple[int, ...]) -> Any:
        if time.monotonic() - self._checked > self._refresh_interval:
            self._switch_version()
        for _ in range(2):  # a second try after the version we knew was dropped
            keys = self.candidate_keys(tail)
            if not keys:
                return None
            self.stats["queries"] += 1
            try:
                row = self._probe_idle(keys)
            except psycopg.errors.UndefinedTable:
                if not self._switch_version():
                    return _FAILED
                continue
            except (psycopg.Error, PoolTimeout) as exc:
                self._note_failure(exc)
                return _FAILED
            return self._to_draft(row)
        return _FAILED

    def _take(self) -> psycopg.Connection[Any]:
        """Take a kept connection, or one more from the pool while fewer than its size are out.

        Connections stay out of the pool between lookups (a pool check-out costs 10-25 us); waiting for one
        is bounded by the lookup timeout.
        """
        deadline = time.monotonic() + self._timeout
        with self._kept:
            while not self._idle:
                if self._out < self._pool.max_size:
                    self._out += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._kept.wait(left):
                    raise PoolTimeout(f"no connection free within {self._timeout:g} s")
            else:
                return self._idle.pop()
        try:
            return self._pool.getconn(timeout=self._timeout)
        except BaseException:
            self._drop(None)
            raise

    def _keep(self, conn: psycopg.Connection[Any]) -> None:
        with self._kept:
            self._idle.append(conn)
            self._kept.notify()

    def _drop(self, conn: psycopg.Connection[Any] | None) -> None:
        """Hand a connection that failed back to the pool, which replaces it if it is broken."""
        if conn is not None:
            self._pool.putconn(conn)
        with self._kept:
            self._out -= 1
            self._kept.notify()

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a kept connection for a statement."""
        conn = self._take()
        try:
            yield conn
        except BaseException:
            self._drop(conn)
            raise
        self._keep(conn)

    def _probe_idle(self, keys: list[bytes]) -> tuple[int, bytes] | None:
        """Probe on a kept connection (the hot path, without a context manager)."""
        conn = self._take()
        try:
            row = self._probe(conn, keys)
        except BaseException:
            self._drop(conn)
            raise
        self._keep(conn)
        return row

    def _probe(self, conn: psycopg.Connection[Any], keys: list[bytes]) -> tuple[int, bytes] | None:
        """Run the lookup of `keys` on libpq directly (the hot path; psycopg's cursor layer costs ~40 us)."""
        pgconn = conn.pgconn
        name = self._names[len(keys)]
        prepared = self._prepared.get(conn)
        if prepared is None:
            with self._lock:
                prepared = self._prepared.setdefault(conn, set())
        if name not in prepared:
            _check(pgconn.prepare(name, self._raw_sql[len(keys)], [_BYTEA] * len(keys)))
            prepared.add(name)
        res = _check(self._run(conn, name, keys))
        if res.ntuples == 0:
            return None
        n, tree = res.get_value(0, 0), res.get_value(0, 1)
        if n is None or tree is None:
            return None
        return int.from_bytes(n, "big", signed=True), tree

    def _run(self, conn: psycopg.Connection[Any], name: bytes, keys: list[bytes]) -> Any:
        """Send the prepared lookup and wait for its result until the lookup timeout, on the client's clock.

        The server's statement_timeout bounds a slow query; this bounds a server that stopped answering: the
        connection is then closed (the pool replaces it) and the lookup fails.
        """
        conn.pgconn.send_query_prepared(name, keys, param_formats=[1] * len(keys), result_format=1)
        return self._wait(conn)

    def _wait(self, conn: psycopg.Connection[Any]) -> Any:
        """Wait for the result of the query sent on `conn` until the lookup timeout; close `conn` past it."""
        pgconn = conn.pgconn
        deadline = time.monotonic() + self._timeout
        result = None
        while True:
            while True:
                sending = pgconn.flush()
                if not sending and not pgconn.is_busy():
                    break
                left = deadline - time.monotonic()
                fd = pgconn.socket
                ready = select.select([fd], [fd] if sending else [], [], max(0.0, left)) if left > 0 else ([], [])
                if not ready[0] and not ready[1]:
                    conn.close()
                    raise psycopg.OperationalError(f"no answer within {self._timeout:g} s; connection closed")
                if ready[0]:
                    pgconn.consume_input()
            res = pgconn.get_result()
            if res is None:
                return result
            if result is None or res.status != pq.ExecStatus.TUPLES_OK:
                result = res

    def _to_draft(self, row: Any) -> Draft | None:
        if row is None:
            return None
        n, tree = row
        try:
            draft = decode_tree(tree, n=int(n), table=self.info.table)
            ranked = tree[:1] == b"\x02" and len(tree) > 1 and tree[1] & 1  # ids from the checked table
            if len(draft) and not ranked and int(draft.tokens.max()) >= self.info.vocab_size:
                raise CodecError(f"a token id is outside the store's vocabulary of {self.info.vocab_size}")
            return draft
        except CodecError as exc:
            self.stats["errors"] += 1
            self._warn_once("codec", f"store {self.name!r} has a corrupt tree (treated as a miss): {exc}")
            return None

    def _set_info(self, info: StoreInfo) -> None:
        self.info = info
        self._sql = {k: lookup_sql(info.id, k) for k in range(1, info.max_n + 1)}
        self._names = {k: f"crest_lookup_s{info.id}_{k}".encode() for k in self._sql}
        self._raw_sql = {k: _numbered(self._sql[k]).encode() for k in self._sql}  # %s -> $1, $2, ...

    def _published_id(self) -> int | None:
        """Return the id of the published version, read within the lookup timeout (None: none published)."""
        with self._connection() as conn:
            conn.pgconn.send_query_params(_PUBLISHED_SQL, [self.name.encode()])
            res = _check(self._wait(conn))
        return int(res.get_value(0, 0)) if res.ntuples else None

    def _switch_version(self) -> bool:
        """Re-read which version is published; on a change, follow it and drop the cache."""
        self._checked = time.monotonic()
        try:
            if self._published_id() == self.info.id:  # the usual case, bounded even if the server stalls
                return True
        except (psycopg.Error, PoolTimeout) as exc:
            self._note_failure(exc)
            return False
        try:
            # a new version's data is read once; give it more than a lookup's timeout
            info = _read_info(self._connection, self.name, known=self.info, data_timeout=max(1.0, 100 * self._timeout))
        except Exception as exc:  # store dropped or database gone: keep serving misses
            self._warn_once("switch", f"store {self.name!r} changed and could not be re-read: {exc}")
            return False
        if self._fingerprint is not None and info.fingerprint != self._fingerprint:
            self._warn_once("fingerprint", f"store {self.name!r} was republished with another tokenizer")
            return False
        if info.id != self.info.id:
            with self._lock:
                self._set_info(info)
                self._cache.clear()
        return True

    def _note_failure(self, exc: BaseException) -> None:
        """Count a failure of the database; the first one is logged (one line for the handle's life)."""
        self.stats["errors"] += 1
        self._warn_once("database", f"store {self.name!r} lookup failed, no drafts while it fails: {exc}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(" ".join(message.split()))  # one line: libpq's messages span several


_BYTEA = 17  # type oid
_PUBLISHED_SQL = b"SELECT id FROM crest_stores WHERE name = $1 AND state = 'published'"
_MISSING: Any = object()


def _numbered(query: str) -> str:
    parts = query.split("%s")
    return "".join(part + (f"${i}" if i < len(parts) else "") for i, part in enumerate(parts, 1))


def _check(res: Any) -> Any:
    """Return a libpq result, or raise the psycopg error its SQLSTATE names."""
    if res.status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        return res
    state = res.error_field(pq.DiagnosticField.SQLSTATE)
    message = (res.error_message or b"").decode(errors="replace").strip() or "lookup failed"
    if state is None:
        raise psycopg.OperationalError(message)
    raise psycopg.errors.lookup(state.decode())(message)


_FAILED: Any = object()


def _read_info(
    connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
    name: str,
    *,
    known: StoreInfo | None = None,
    data_timeout: float = 10.0,
) -> StoreInfo:
    try:
        with connection() as conn:
            row = conn.execute(INFO_SQL, (name,)).fetchone()
    except (psycopg.Error, PoolTimeout) as exc:
        raise ConnectionUnavailable(f"cannot read store {name!r}: {exc}") from None
    if row is None:
        raise StoreNotFound(f"no published store named {name!r}")
    sid, fingerprint, vocab_size, width, params, tokenizer = row
    if known is not None and known.id == int(sid):
        table, key_filter = known.table, known.key_filter  # same version: its data never changes
    else:
        table, key_filter = _read_data(connection, name, int(sid), int(vocab_size), timeout=data_timeout)
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
    )


def _read_data(
    connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
    name: str,
    store_id: int,
    vocab: int,
    *,
    timeout: float,
) -> tuple[TokenTable | None, KeyFilter | None]:
    """Read a version's token table and key filter (None, None for stores older than them)."""
    try:
        with connection() as conn, conn.transaction():  # a transaction: SET LOCAL ends with it
            conn.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout * 1000))}")
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


class _OwnPoolRecords(logging.Filter):
    """Drops psycopg_pool's records about the SDK's pools: `Store` reports their failures itself, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(_is_own_pool(arg) for arg in args)


def _is_own_pool(value: object) -> bool:
    """Return whether `value` is one of the SDK's pools, its name, or a connection or task of one."""
    if isinstance(value, str):
        return value.startswith(POOL_PREFIX)
    pool = getattr(value, "_pool", None) or getattr(value, "pool", None) or value  # a connection, a task, a pool
    if isinstance(pool, weakref.ref):
        pool = pool()
    return str(getattr(pool, "name", "")).startswith(POOL_PREFIX)


logging.getLogger("psycopg.pool").addFilter(_OwnPoolRecords())
