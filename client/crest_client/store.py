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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool, PoolTimeout

from crest_client.batch_codec import decode_trees
from crest_client.choice import choose, resolve_rule
from crest_client.codec import decode_tree
from crest_client.draft import Draft
from crest_client.errors import (
    CodecError,
    ConnectionUnavailable,
    FingerprintMismatch,
    StoreNotFound,
)
from crest_client.hosts import check_dsn, resolve_read_dsn
from crest_client.info import PUBLISHED_SQL, StoreInfo, read_info
from crest_client.keyfilter import suffix_hashes
from crest_client.lookup import (
    BYTEA_ARRAY,
    INT4_ARRAY,
    batch_keys,
    batch_sql,
    bytea_array,
    check_result,
    int4_array,
    numbered,
    probe_sql,
)
from crest_client.names import check_store_name

log = logging.getLogger(__name__)

POOL_PREFIX = "crest-client-"  # the names of the SDK's pools, whose failures `Store` reports itself, once

lookup_sql = probe_sql  # the name earlier releases exported

__all__ = ["Store", "StoreInfo", "lookup_sql"]


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
        live: StoreInfo | None = None,
        follow_live: bool = True,
        rule: str | None = None,
        write_dsn: str | None = None,
    ) -> None:
        self.rule = resolve_rule(rule)  # which stored suffix drafts: crest_client.choice
        self._write_dsn = write_dsn  # where `learn` appends (the primary); None: CREST_DATABASE_URL or embedded
        self._learner: Any = None
        self._pool = pool
        self.info = info
        self.live = live if follow_live else None  # the published live tier (learned from served requests)
        self._follow_live = follow_live
        self.name = info.name
        self._fingerprint = tokenizer_fingerprint
        self._cache_size = max(0, int(cache_size))
        self._cache: OrderedDict[tuple[int, ...], Draft | None] = OrderedDict()  # static tier, by tail
        self._live_cache: OrderedDict[tuple[int, ...], Draft | None] = OrderedDict()  # live tier, by tail
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
        live: bool = True,
        rule: str | None = None,
        write_dsn: str | None = None,
    ) -> Store:
        """Connect to the published store `name` (DSN: argument, else CREST_READ_DATABASE_URL, else as writers).

        With `live` (the default) the handle also follows the store's live tier, when one is published:
        `draft_parts` and `draft_many_parts` return its candidates beside the static ones. The DSN may name
        several servers (`host=a,b port=p,q`, `target_session_attrs`, `load_balance_hosts`): a connection that
        breaks is replaced by one to the first server that answers (`crest_client.hosts`).
        """
        check_store_name(name)
        given = dsn  # also where `learn` writes, unless write_dsn names the primary
        dsn = check_dsn(resolve_read_dsn(dsn))
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
            info = read_info(pool.connection, name, data_timeout=connect_timeout)
            live_info = _read_live(pool.connection, name, info, data_timeout=connect_timeout) if live else None
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
            live=live_info,
            follow_live=live,
            rule=rule,
            write_dsn=write_dsn or given,
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
        if time.monotonic() - self._checked > self._refresh_interval:
            self._switch_version()  # also on cache hits: a live tier published meanwhile is found
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
        """Return the static tier's drafts for many contexts, all looked up in one statement."""
        return [parts[0] for parts in self.draft_many_parts(contexts, max_nodes, live=False)]

    def draft_parts(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int = 64) -> list[Draft | None]:
        """Return [static draft, live draft] for the context, both looked up in one round trip."""
        return self.draft_many_parts([context_ids], max_nodes)[0]

    def draft_many_parts(
        self, contexts: Sequence[Sequence[int] | np.ndarray], max_nodes: int = 64, *, live: bool = True
    ) -> list[list[Draft | None]]:
        """Return [static draft, live draft] for each context: every lookup of both tiers in one statement."""
        if time.monotonic() - self._checked > self._refresh_interval:
            self._switch_version()
        infos = [self.info] + ([self.live] if live and self.live is not None else [])
        caches = (self._cache, self._live_cache)
        out: list[list[Draft | None]] = [[None, None] for _ in contexts]
        tails = [tuple(int(t) for t in ctx[-self.info.max_n :]) for ctx in contexts]
        self.stats["lookups"] += len(contexts)
        missing: list[list[int]] = []
        params: list[Any] = []
        with self._lock:
            for part, _ in enumerate(infos):
                cache, todo = caches[part], []
                for i, tail in enumerate(tails):
                    found = cache.get(tail, _MISSING) if self._cache_size else _MISSING
                    if found is _MISSING:
                        if tail:
                            todo.append(i)
                    else:
                        out[i][part] = found.truncate(max_nodes) if found is not None else None
                missing.append(todo)
        self.stats["hits"] += len(contexts) - len(missing[0])
        for part, info in enumerate(infos):
            index, keys = batch_keys([tails[i] for i in missing[part]], info)
            params += [[missing[part][j] for j in index], keys]
        if not any(params[1::2]):
            self._remember(infos, missing, tails, {})
            return out
        self.stats["queries"] += 1
        try:
            rows = self._run_batch(tuple(info.id for info in infos), params)
        except psycopg.errors.UndefinedTable:
            self._switch_version()
            return out
        except (psycopg.Error, PoolTimeout) as exc:
            self._note_failure(exc)
            return out
        drafts: dict[tuple[int, int], Draft | None] = {}
        for part, info in enumerate(infos):
            chosen = self._pick([row for row in rows if row[1] == part], info)
            for (i, *_), draft in zip(chosen, self._to_drafts([(r[2], r[4]) for r in chosen], info), strict=True):
                drafts[(part, i)] = draft
        self._remember(infos, missing, tails, drafts)
        for (part, i), draft in drafts.items():
            out[i][part] = draft.truncate(max_nodes) if draft is not None else None
        return out

    def _run_batch(self, ids: tuple[int, ...], params: list[Any]) -> list[tuple[int, int, int, int, bytes]]:
        """Run the batch lookup of versions `ids` on libpq directly: rows (context index, part, n, count, tree)."""
        every = self.rule != "longest"
        name = f"crest_batch_{self.rule}_s{'_'.join(map(str, ids))}".encode()
        conn = self._take()
        try:
            prepared = self._prepared.get(conn)
            if prepared is None:
                with self._lock:
                    prepared = self._prepared.setdefault(conn, set())
            pgconn = conn.pgconn
            if name not in prepared:
                query = numbered(batch_sql(ids, every=every)).encode()
                check_result(pgconn.prepare(name, query, [INT4_ARRAY, BYTEA_ARRAY] * len(ids)))
                prepared.add(name)
            values = [int4_array(p) if j % 2 == 0 else bytea_array(p) for j, p in enumerate(params)]
            pgconn.send_query_prepared(name, values, param_formats=[1] * len(values), result_format=1)
            res = check_result(self._wait(conn))
            get = res.get_value
            rows = [
                (_int(get(r, 0)), _int(get(r, 1)), _int(get(r, 2)), _int(get(r, 3)), get(r, 4))
                for r in range(res.ntuples)
            ]
        except BaseException:
            self._drop(conn)
            raise
        self._keep(conn)
        return rows

    def _pick(
        self, rows: list[tuple[int, int, int, int, bytes]], info: StoreInfo
    ) -> list[tuple[int, int, int, int, bytes]]:
        """Return one row per context: the only one (longest rule), else the rule's choice among its suffixes."""
        if self.rule == "longest":
            return rows
        groups: dict[int, list[tuple[int, int, int, int, bytes]]] = {}
        for row in rows:
            groups.setdefault(row[0], []).append(row)
        limit = self._max_matches(info)
        return [group[choose([(r[2], r[3], r[4]) for r in group], max_matches=limit)] for group in groups.values()]

    @staticmethod
    def _max_matches(info: StoreInfo) -> int:
        return int(info.params.get("max_matches", 5000) or 5000)

    def _remember(
        self,
        infos: list[StoreInfo],
        missing: list[list[int]],
        tails: list[tuple[int, ...]],
        found: dict[tuple[int, int], Draft | None],
    ) -> None:
        """Cache each looked-up tail's draft (None for a miss) in its tier's cache."""
        if not self._cache_size:
            return
        with self._lock:
            for part, info in enumerate(infos):
                cache = (self._cache, self._live_cache)[part]
                if info is not (self.info, self.live)[part]:
                    continue  # the version changed meanwhile
                for i in missing[part]:
                    if tails[i]:
                        cache[tails[i]] = found.get((part, i))
                while len(cache) > self._cache_size:
                    cache.popitem(last=False)

    def learn(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        prompt_tokens: int = 0,
        stats: Mapping[str, int] | None = None,
    ) -> None:
        """Queue served tokens for the store's learned log (written in the background; never blocks or raises).

        The first `prompt_tokens` ids are context (the prompt's tail), the rest the served output; `stats` the
        request's figures (`crest_client.learner.STATS`). Rows go to `write_dsn` (the primary), else
        CREST_DATABASE_URL, else the embedded default, through a `Learner`.
        """
        learner = self._learner
        if learner is None:
            from crest_client.learner import Learner

            with self._lock:
                if self._learner is None:
                    self._learner = Learner(self._write_dsn, self.name, source="sdk")
                learner = self._learner
        learner.learn(token_ids, prompt_tokens=prompt_tokens, stats=stats)

    def clear_cache(self) -> None:
        """Forget every cached draft."""
        with self._lock:
            self._cache.clear()
            self._live_cache.clear()

    def close(self) -> None:
        """Write what `learn` queued, and close the pool."""
        if self._learner is not None:
            self._learner.close()
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
            check_result(pgconn.prepare(name, self._raw_sql[len(keys)], [_BYTEA] * len(keys)))
            prepared.add(name)
        res = check_result(self._run(conn, name, keys))
        if res.ntuples == 0:
            return None
        if self.rule == "longest":
            n, tree = res.get_value(0, 0), res.get_value(0, 1)
            return (_int(n), tree) if n is not None and tree is not None else None
        rows = [(_int(res.get_value(r, 0)), _int(res.get_value(r, 1)), res.get_value(r, 2)) for r in range(res.ntuples)]
        n, _, tree = rows[choose(rows, max_matches=self._max_matches(self.info))]
        return n, tree

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

    def _to_drafts(self, rows: list[tuple[int, bytes]], info: StoreInfo) -> list[Draft | None]:
        """Decode many (n, tree) rows at once; on a corrupt one, each alone (a corrupt tree is a miss)."""
        if not rows:
            return []
        try:
            drafts = decode_trees([tree for _, tree in rows], [n for n, _ in rows], table=info.table)
        except CodecError:
            return [self._to_draft(row, info) for row in rows]
        for (_, tree), draft in zip(rows, drafts, strict=True):
            ranked = tree[:1] == b"\x02" and len(tree) > 1 and tree[1] & 1  # ids from the checked table
            if len(draft) and not ranked and int(draft.tokens.max()) >= info.vocab_size:
                return [self._to_draft(row, info) for row in rows]
        return list(drafts)

    def _to_draft(self, row: Any, info: StoreInfo | None = None) -> Draft | None:
        if row is None:
            return None
        info = info or self.info
        n, tree = row
        try:
            draft = decode_tree(tree, n=int(n), table=info.table)
            ranked = tree[:1] == b"\x02" and len(tree) > 1 and tree[1] & 1  # ids from the checked table
            if len(draft) and not ranked and int(draft.tokens.max()) >= info.vocab_size:
                raise CodecError(f"a token id is outside the store's vocabulary of {info.vocab_size}")
            return draft
        except CodecError as exc:
            self.stats["errors"] += 1
            self._warn_once("codec", f"store {self.name!r} has a corrupt tree (treated as a miss): {exc}")
            return None

    def _set_info(self, info: StoreInfo) -> None:
        self.info = info
        every = self.rule != "longest"
        self._sql = {k: probe_sql(info.id, k, every=every) for k in range(1, info.max_n + 1)}
        self._names = {k: f"crest_{self.rule}_s{info.id}_{k}".encode() for k in self._sql}
        self._raw_sql = {k: numbered(self._sql[k]).encode() for k in self._sql}  # %s -> $1, $2, ...

    def _published_ids(self) -> dict[str, int]:
        """Return the published version of each tier, read within the lookup timeout."""
        with self._connection() as conn:
            conn.pgconn.send_query_params(PUBLISHED_SQL, [self.name.encode()])
            res = check_result(self._wait(conn))
        return {res.get_value(r, 0).decode(): int(res.get_value(r, 1)) for r in range(res.ntuples)}

    def _switch_version(self) -> bool:
        """Re-read which versions are published; on a change, follow them and drop their caches."""
        self._checked = time.monotonic()
        try:
            published = self._published_ids()
        except (psycopg.Error, PoolTimeout) as exc:
            self._note_failure(exc)
            return False
        live_id = published.get("live") if self._follow_live else None
        if live_id != (self.live.id if self.live is not None else None):
            self._switch_live(live_id)
        if published.get("static") == self.info.id:  # the usual case, bounded even if the server stalls
            return True
        try:
            # a new version's data is read once; give it more than a lookup's timeout
            info = read_info(self._connection, self.name, known=self.info, data_timeout=max(1.0, 100 * self._timeout))
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

    def _switch_live(self, live_id: int | None) -> None:
        """Follow the live tier to version `live_id` (None: no live tier any more)."""
        live = None
        if live_id is not None:
            try:
                live = _read_live(self._connection, self.name, self.info, data_timeout=max(1.0, 100 * self._timeout))
            except Exception as exc:  # keep the live version we know; the next check tries again
                self._warn_once("live", f"store {self.name!r}: its live tier could not be read: {exc}")
                return
        with self._lock:
            self.live = live
            self._live_cache.clear()

    def _note_failure(self, exc: BaseException) -> None:
        """Count a failure of the database; the first one is logged (one line for the handle's life)."""
        self.stats["errors"] += 1
        self._warn_once("database", f"store {self.name!r} lookup failed, no drafts while it fails: {exc}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(" ".join(message.split()))  # one line: libpq's messages span several


_BYTEA = 17  # type oid
_MISSING: Any = object()


_FAILED: Any = object()


def _int(value: bytes) -> int:
    """Return a binary int2/int4 result value."""
    return int.from_bytes(value, "big", signed=True)


def _read_live(connection: Any, name: str, static: StoreInfo, *, data_timeout: float) -> StoreInfo | None:
    """Return the store's published live tier when it has one built with the static tier's tokenizer."""
    try:
        live = read_info(connection, name, tier="live", data_timeout=data_timeout)
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
