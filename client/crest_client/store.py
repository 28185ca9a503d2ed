"""`Store`: the SDK's handle on one published crest store.

`draft(context_ids)` looks the context up as a batch of one (`draft_many_parts`): the keys of the context's suffixes
that the version's key filter may hold (`crest_client._batch_lookup`, keys from
`crest_client.lookup.candidate_keys`: a Bloom filter loaded once per version; it never drops a stored key) are
probed in one prepared statement that returns the longest stored one (a store whose suffix trees were decided at
ingest needs no more), or with the `expected` rule on an older store every stored one, among which
`crest_client.choice` picks. A context none of whose suffixes passes the filter costs no round trip. Tree blobs are
decoded into `Draft`s with the version's token table. The handle re-reads which versions are published every
`refresh_interval` seconds and whenever its partition is gone, so readers move to a new version once it is
published, and never see a mix of two. Results are kept in bounded LRU caches per tier, by the last max-n tokens
and by key (`crest_client._cache`: a new context whose longest stored suffix is known takes no round trip).
Connections come from a psycopg pool (`crest_client._connections`): one `Store` is safe to share between threads,
and in a child made by `os.fork()` it has connections, locks and threads of its own (`crest_client._fork`). Failures
of the database (down, slow, restarting) and corrupt rows make a lookup return None: generation goes on."""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from crest_client._batch_lookup import fetch_drafts, fetches_every
from crest_client._cache import TierCaches
from crest_client._connections import (
    ENV_LOOKUP_SPIN,
    ENV_LOOKUP_TIMEOUT,
    LOOKUP_TIMEOUT,
    SPIN,
    Connections,
    LookupTimeout,
    check_max_nodes,
    check_seconds,
    open_pool,
    resolve_seconds,
)
from crest_client._fork import renew_in_child
from crest_client.choice import resolve_rule
from crest_client.draft import Draft
from crest_client.errors import CrestClientError, FingerprintMismatch
from crest_client.hosts import check_dsn, resolve_read_dsn
from crest_client.info import PUBLISHED_SQL, StoreInfo, read_info, read_live
from crest_client.lookup import candidate_keys, suffix_keys, usable_tail
from crest_client.names import check_store_name
from crest_client.tiers import TIERS, merge_parts

log = logging.getLogger(__name__)


__all__ = ["SPIN", "Store", "StoreInfo"]


class Store:
    """A pooled, cached reader of one crest store."""

    def __init__(
        self,
        pool: ConnectionPool,
        info: StoreInfo,
        *,
        tokenizer_fingerprint: str | None = None,
        cache_size: int = 4096,
        timeout: float = LOOKUP_TIMEOUT,
        refresh_interval: float = 1.0,
        live: StoreInfo | None = None,
        follow_live: bool = True,
        rule: str | None = None,
        write_dsn: str | None = None,
        spin: float = SPIN,
    ) -> None:
        self.rule = resolve_rule(rule)  # which stored suffix drafts, unless decided at ingest: crest_client.choice
        self._write_dsn = write_dsn  # where `learn` appends (the primary); None: CREST_DATABASE_URL or embedded
        self._learner: Any = None
        self._conns = Connections(pool, timeout=timeout, spin=spin)
        self.info = info
        self.live = live if follow_live else None  # the published live tier (learned from served requests)
        self._follow_live = follow_live
        self.name = info.name
        self._fingerprint = tokenizer_fingerprint
        self._lock = threading.Lock()
        self._caches = TierCaches(cache_size, self._lock)
        self._timeout = float(timeout)
        self._refresh_interval = float(refresh_interval)
        self._checked = time.monotonic()
        self._warned: set[str] = set()
        self._loader: threading.Thread | None = None  # reads a newly published version off the lookup path
        self._read_wait = max(1.0, 100 * self._timeout)  # its statements' timeout: a table read, not a lookup
        self._load_result: bool | None = None  # the last load: True followed, False could not be followed
        self.stats = {"lookups": 0, "hits": 0, "errors": 0, "timeouts": 0, "queries": 0}
        renew_in_child(self)  # its connections renew themselves (crest_client._connections), its learner too

    @classmethod
    def connect(
        cls,
        dsn: str | None = None,
        name: str = "default",
        *,
        tokenizer_fingerprint: str | None = None,
        cache_size: int = 4096,
        timeout: float | None = None,
        refresh_interval: float = 1.0,
        pool_size: int = 4,
        connect_timeout: float = 10.0,
        live: bool = True,
        rule: str | None = None,
        write_dsn: str | None = None,
        spin: float | None = None,
    ) -> Store:
        """Connect to the published store `name` (DSN: argument, else CREST_READ_DATABASE_URL, else as writers).

        With `live` (the default) the handle also follows the store's live tier, when one is published:
        `draft_parts` and `draft_many_parts` return its candidates beside the static ones. The DSN may name
        several servers (`host=a,b port=p,q`, `target_session_attrs`, `load_balance_hosts`): a connection that
        breaks is replaced by one to the first server that answers (`crest_client.hosts`). A lookup busy-polls
        for its answer for up to `spin` seconds while the machine has an idle CPU (0: it always sleeps). A lookup
        may take `timeout` seconds; unset, `timeout` and `spin` come from CREST_LOOKUP_TIMEOUT and CREST_LOOKUP_SPIN,
        else 0.01 and 0.0002 (a database across a network may need a longer timeout: past it, no draft).
        """
        check_store_name(name)
        timeout = resolve_seconds(timeout, env=ENV_LOOKUP_TIMEOUT, default=LOOKUP_TIMEOUT, zero=False, arg="timeout")
        spin = resolve_seconds(spin, env=ENV_LOOKUP_SPIN, default=SPIN, arg="spin")
        refresh_interval = check_seconds(refresh_interval, name="refresh_interval", most=math.inf)  # inf: never
        connect_timeout = check_seconds(connect_timeout, name="connect_timeout", zero=False)
        for what, count, least in (("cache_size", cache_size, 0), ("pool_size", pool_size, 1)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < least:
                raise CrestClientError(f"{what} must be a whole number >= {least}, got {count!r}")
        given = dsn  # also where `learn` writes, unless write_dsn names the primary
        dsn = check_dsn(resolve_read_dsn(dsn))
        pool = open_pool(dsn, name, timeout=timeout, pool_size=pool_size, connect_timeout=connect_timeout)
        try:
            wait = connect_timeout  # the first reads wait as long as connecting may, not a lookup's timeout
            info = read_info(pool.connection, name, data_timeout=wait, info_timeout=wait)
            live_info = read_live(pool.connection, name, info, data_timeout=wait, info_timeout=wait) if live else None
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
            spin=spin,
        )

    def keys(self, context_ids: Sequence[int] | np.ndarray) -> list[bytes | None]:
        """Return the keys of the context's suffixes, longest (max n) first; None where too short ([]: last token
        outside the vocabulary)."""
        tail = usable_tail(context_ids, self.info.max_n, self.info.vocab_size)
        return [] if len(context_ids) and not tail else suffix_keys(tail, self.info.token_width, self.info.max_n)

    def candidate_keys(self, tail: Sequence[int]) -> list[bytes]:
        """Return the keys of the tail's suffixes that may be stored (all, without a filter), longest first."""
        return candidate_keys([tail], self.info)[1]

    def draft(
        self, context_ids: Sequence[int] | np.ndarray, max_nodes: int = 64, *, tier: str | None = None
    ) -> Draft | None:
        """Return the context's tree: every published tier's merged (`crest_client.tiers`), or one `tier`'s; or None.

        A single lookup is a batch of one: `draft(c)` is `draft_many([c])[0]`. The handle keeps no per-sequence
        state (it is shared between threads and requests), so the tiers merge with equal scales; a caller that
        follows one sequence learns each tier's scale itself (`crest_client.tiers.PartScales` over `draft_parts`,
        as crest's drafters do per request).
        """
        return self._drafts([context_ids], max_nodes, tier=tier)[0]

    def draft_many(
        self, contexts: Sequence[Sequence[int] | np.ndarray], max_nodes: int = 64, *, tier: str | None = None
    ) -> list[Draft | None]:
        """Return the drafts for many contexts (tiers merged, or one `tier`'s), all looked up in one statement."""
        return self._drafts(contexts, max_nodes, tier=tier)

    def _drafts(
        self, contexts: Sequence[Sequence[int] | np.ndarray], max_nodes: int, *, tier: str | None
    ) -> list[Draft | None]:
        if tier is not None and tier not in TIERS:
            raise CrestClientError(f"unknown tier {tier!r}: use {' or '.join(TIERS)}, or None for all")
        if check_max_nodes(max_nodes) == 0:
            return [None] * len(contexts)
        if tier == "static" or (tier is None and self.live is None):
            return [parts[0] for parts in self.draft_many_parts(contexts, max_nodes, live=False)]
        found = self.draft_many_parts(contexts, max_nodes)
        if tier == "live":
            return [parts[1] for parts in found]
        scales = [1.0] * len(TIERS)
        return [merge_parts(parts, scales, max_nodes=max_nodes) for parts in found]

    def draft_parts(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int = 64) -> list[Draft | None]:
        """Return [static draft, live draft] for the context, both looked up in one round trip."""
        return self.draft_many_parts([context_ids], max_nodes)[0]

    def draft_many_parts(
        self, contexts: Sequence[Sequence[int] | np.ndarray], max_nodes: int = 64, *, live: bool = True
    ) -> list[list[Draft | None]]:
        """Return [static draft, live draft] for each context: every lookup of both tiers in one statement."""
        if check_max_nodes(max_nodes) == 0:
            return [[None, None] for _ in contexts]
        answered = True
        if time.monotonic() - self._checked > self._refresh_interval:  # also on cache hits: a new live tier
            answered = self._switch_version() is not None
        out: list[list[Draft | None]] = [[None, None] for _ in contexts]
        self.stats["lookups"] += len(contexts)
        for attempt in range(2):  # a second try after the version we knew was dropped
            max_n = self.info.max_n  # a version switched to may hold longer n-grams
            tails = [tuple(map(int, ctx[-max_n:])) for ctx in contexts]
            infos = [self.info] + ([self.live] if live and self.live is not None else [])
            keyed = [None if fetches_every(info, self.rule) else info for info in infos]  # longest suffix: by key
            missing = self._caches.fill(len(infos), tails, out, max_nodes, keyed=keyed)
            if attempt == 0:
                self.stats["hits"] += len(contexts) - len(missing[0])
            if not answered:  # the version check just waited its timeout in vain: cached drafts only this call
                return out
            try:
                found = fetch_drafts(
                    self._conns, infos, tails, missing, rule=self.rule, stats=self.stats, corrupt=self._corrupt
                )
            except psycopg.errors.UndefinedTable:
                if self._switch_version():
                    continue
                return out
            except (psycopg.Error, PoolTimeout) as exc:
                self._note_failure(exc)
                return out
            current = [info is (self.info, self.live)[part] for part, info in enumerate(infos)]
            self._caches.remember(current, missing, tails, found, keyed=keyed)
            for (part, i), draft in found.items():
                out[i][part] = draft.truncate(max_nodes) if draft is not None else None
            return out
        return out

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
            self._caches.clear()

    def close(self) -> None:
        """Write what `learn` queued, let a version being read finish, and close the pool."""
        if self._learner is not None:
            self._learner.close()
        if self._loader is not None:
            self._loader.join(2 * self._read_wait + 1.0)  # bounded by the version read's two statement timeouts
        self._conns.close()

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (a parent's thread may have held it); a new version loads on a new thread."""
        self._lock = self._caches.lock = threading.Lock()
        self._loader, self._load_result = None, None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A handle dropped while open keeps its pool's connections and threads until the pool is collected: say so,
        # as psycopg does for a connection (the pool's own connections never warn).
        conns = getattr(self, "_conns", None)
        if conns is not None and not conns.pool.closed:
            warnings.warn(
                f"crest store {self.name!r} was never closed: use `with Store.connect(...)` or call close()",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    def _corrupt(self, error: str) -> None:
        """Count a corrupt tree (a miss) and log the first one."""
        self.stats["errors"] += 1
        self._warn_once("codec", f"store {self.name!r} has a corrupt tree (treated as a miss): {error}")

    def _switch_version(self) -> bool | None:
        """Re-read which versions are published; follow a change, read by a thread the lookup waits for at most one
        lookup timeout (it drafts from the version it knows meanwhile). Return True: current, False: a new one not
        followed (yet, or at all), None: the database did not answer."""
        self._checked = time.monotonic()
        try:
            res = self._conns.run_params(PUBLISHED_SQL, [self.name.encode()])
        except (psycopg.Error, PoolTimeout) as exc:
            self._note_failure(exc)
            return None
        published = {res.get_value(r, 0).decode(): int(res.get_value(r, 1)) for r in range(res.ntuples)}
        static_id = published.get("static")
        live_id = published.get("live") if self._follow_live else None
        if static_id == self.info.id and live_id == (self.live.id if self.live is not None else None):
            return True  # the usual case, bounded even if the server stalls
        if static_id is None:  # dropped: nothing of it drafts any more, not even from the cache
            with self._lock:
                self._caches.clear()
            self._warn_once("switch", f"store {self.name!r} was dropped: no drafts from it until it is published")
            return False
        loader = self._loader
        if loader is None or not loader.is_alive():
            loader = self._loader = threading.Thread(
                target=self._load, args=(static_id, live_id), name=f"crest-version-{self.name}", daemon=True
            )
            loader.start()
        loader.join(self._timeout)
        if loader.is_alive():
            return False  # still reading: this lookup uses the version it knows
        return bool(self._load_result) and static_id == self.info.id

    def _load(self, static_id: int | None, live_id: int | None) -> None:
        """Read the published static version (when it changed), then the live tier; swap them in (a thread)."""
        self._load_result = False
        if static_id != self.info.id:
            try:
                conn, wait = self._conns.connection, self._read_wait  # read once: more than a lookup's timeout
                info = read_info(conn, self.name, known=self.info, data_timeout=wait, info_timeout=wait)
            except Exception as exc:  # store dropped or database gone: keep serving misses
                self._warn_once("switch", f"store {self.name!r} changed and could not be re-read: {exc}")
                return
            if self._fingerprint is not None and info.fingerprint != self._fingerprint:
                self._warn_once("fingerprint", f"store {self.name!r} was republished with another tokenizer")
                return
            with self._lock:
                self.info = info
                self._caches.clear(0)
        if live_id != (self.live.id if self.live is not None else None):
            self._switch_live(live_id)
        self._load_result = True

    def _switch_live(self, live_id: int | None) -> None:
        """Follow the live tier to version `live_id` (None: no live tier any more)."""
        live = None
        if live_id is not None:
            try:
                wait = self._read_wait
                live = read_live(self._conns.connection, self.name, self.info, data_timeout=wait, info_timeout=wait)
            except Exception as exc:  # keep the live version we know; the next check tries again
                self._warn_once("live", f"store {self.name!r}: its live tier could not be read: {exc}")
                return
        with self._lock:
            self.live = live
            self._caches.clear(1)

    def _note_failure(self, exc: BaseException) -> None:
        """Count a failure of the database; the first one is logged (one line for the handle's life).

        A lookup slower than its timeout is the timeout doing its job under load, not a failure: it is counted
        in `stats["timeouts"]` and said once at INFO.
        """
        if isinstance(exc, LookupTimeout | PoolTimeout | psycopg.errors.QueryCanceled):
            self.stats["timeouts"] += 1
            if "timeout" not in self._warned:
                self._warned.add("timeout")
                log.info("store %r: a lookup took longer than its timeout; that step drafts without it "
                         "(counted in stats['timeouts'], said once)", self.name)  # fmt: skip
            return
        self.stats["errors"] += 1
        self._warn_once("database", f"store {self.name!r} lookup failed, no drafts while it fails: {exc}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(" ".join(message.split()))  # one line: libpq's messages span several
