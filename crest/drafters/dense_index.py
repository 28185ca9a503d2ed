"""The dense part of a published store, opened for lookups: its projection, its model check and batched ANN search.

`open_dense` resolves the store's published static version and reads its dense part (`crest.db.dense`): a store
that is missing, built with another tokenizer or without a dense part is an error at once; a database that does
not answer is said once, and the index then finds nothing (no drafts, no error) and tries again on a later
lookup every `retry_interval` seconds. `search` turns the target's hidden states into unit query vectors and
returns every query's nearest rows in one statement, the live version's dense part included once a refresh
published one (`crest.learning.live_dense`: looked for every `LIVE_INTERVAL` seconds); any database error costs
that lookup only. A new version published under the name is picked up when the old version's table is gone
(retired and dropped).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import psycopg
from crest_client.errors import ConnectionUnavailable, FingerprintMismatch, StoreNotFound
from crest_client.hosts import resolve_read_dsn
from crest_client.names import check_store_name

from crest.db import dense as dense_db
from crest.drafters.store import CONNECT_TIMEOUT, RETRY_INTERVAL
from crest.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

NEIGHBOURS = 16  # k: stored states fetched per lookup

LIVE_INTERVAL = 1.0  # seconds between looks for a newly published live dense part (the client's refresh_interval)
Neighbours = list[tuple[list[int], float]]  # (continuation token ids, cosine similarity), best first


class DenseIndex:
    """One published store's dense part, looked up through its own connection (not thread-safe)."""

    def __init__(
        self,
        store: str,
        *,
        dsn: str | None = None,
        fingerprint: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        retry_interval: float = RETRY_INTERVAL,
    ) -> None:
        self.store, self.dsn, self.fingerprint = store, dsn, fingerprint
        self.connect_timeout, self.retry_interval = connect_timeout, retry_interval
        self.meta: dense_db.DenseMeta | None = None
        self.live: int | None = None  # the published live version with a dense part projected like `meta`'s
        self._live_next = 0.0  # when to look for a newer live version again
        self.model_fingerprint: str | None = None  # of the model bound to it, checked once the meta is known
        self._conn: psycopg.Connection[Any] | None = None
        self.lookups = 0  # search statements sent (one per call, whatever the batch)
        self._next_try = 0.0
        self._warned = False

    def check_model(self, fingerprint: str) -> None:
        """Remember the querying model; ModelError when the dense part is known to be built with another one."""
        self.model_fingerprint = fingerprint
        if self.meta is not None and self.meta.model_fingerprint != fingerprint:
            raise ModelError(
                f"store {self.store!r}'s dense part was built with model {self.meta.model!r} (fingerprint "
                f"{self.meta.model_fingerprint}); this model's fingerprint is {fingerprint}: generate with that "
                "model or rebuild the dense part with `crest ingest --dense-model`"
            )

    def search(self, hidden: np.ndarray, *, k: int) -> list[Neighbours]:
        """Return the `k` nearest rows of each hidden state [B, H]; empty lists while the database is down."""
        empty: list[Neighbours] = [[] for _ in range(len(hidden))]
        if not self._ready():
            return empty
        assert self.meta is not None and self._conn is not None
        if self.model_fingerprint is not None and self.meta.model_fingerprint != self.model_fingerprint:
            return empty  # refused when bound; a version built since with another model drafts nothing
        try:
            if time.monotonic() >= self._live_next:
                self._read_live()
            self.lookups += 1
            queries, vector = self.meta.project(hidden), self.meta.index.vector
            if self.live is not None:  # static and live entries in one statement
                return dense_db.search_with_live(self._conn, self.meta.store_id, self.live, queries, k=k, vector=vector)
            return dense_db.search(self._conn, self.meta.store_id, queries, k=k, vector=vector)
        except psycopg.errors.UndefinedTable:
            self.meta = None  # the version was retired and dropped: read the published one on the next lookup
        except (psycopg.Error, OSError) as exc:
            self._lost(exc)
        return empty

    def open(self) -> DenseIndex:
        """Read the dense part now; a database that does not answer is logged once (lookups find nothing meanwhile)."""
        try:
            self._connect()
        except ConnectionUnavailable as exc:
            self._lost(exc)
        except BaseException:
            self.close()  # a missing store or dense part raises: the connection it was read through goes too
            raise
        return self

    def close(self) -> None:
        """Close the connection."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _ready(self) -> bool:
        if self._conn is not None and not self._conn.closed and self.meta is not None:
            return True
        if time.monotonic() < self._next_try:
            return False
        try:
            self._connect()
        except (ConnectionUnavailable, psycopg.Error, OSError) as exc:
            self._lost(exc)
            return False
        except Exception as exc:  # the store went away or changed since it was opened: no drafts, said once
            self._lost(exc)
            return False
        return True

    def _connect(self) -> None:
        """Connect (when not connected) and read the published version's dense part (errors as `open_dense`)."""
        if self._conn is None or self._conn.closed:
            try:
                url = resolve_read_dsn(self.dsn)
                self._conn = psycopg.connect(
                    url, autocommit=True, connect_timeout=max(1, round(self.connect_timeout)), application_name="crest"
                )
            except psycopg.OperationalError as exc:
                raise ConnectionUnavailable(f"cannot reach the database: {str(exc).strip()}") from None
        self.meta = _published_meta(self._conn, self.store, fingerprint=self.fingerprint)
        dense_db.tune(self._conn, self.meta.index)  # the search setting of the index this version was built with
        self._read_live()
        if self._warned:
            log.warning("store %r's dense part answers again", self.store)
            self._warned = False
        if self.model_fingerprint is not None:
            self.check_model(self.model_fingerprint)

    def _read_live(self) -> None:
        """Read which live version's dense part the searches add (every LIVE_INTERVAL seconds: refreshes publish)."""
        assert self._conn is not None and self.meta is not None
        row = self._conn.execute(
            "SELECT l.id FROM crest_stores l JOIN crest_dense d ON d.store_id = l.id WHERE l.name = %s"
            " AND l.tier = 'live' AND l.state = 'published' AND (d.figures ->> 'static_version')::bigint = %s",
            (self.store, self.meta.store_id),
        ).fetchone()
        self.live = int(row[0]) if row else None
        self._live_next = time.monotonic() + LIVE_INTERVAL

    def _lost(self, exc: BaseException) -> None:
        self.close()
        self._next_try = time.monotonic() + self.retry_interval
        if not self._warned:
            self._warned = True
            log.warning(
                "store %r's dense part is unreachable, drafting without it (retrying every %g s): %s",
                self.store,
                self.retry_interval,
                str(exc).strip(),
            )


def open_dense(
    store: str,
    *,
    dsn: str | None = None,
    fingerprint: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    retry_interval: float = RETRY_INTERVAL,
) -> DenseIndex:
    """Return the dense part of the published store `name`, opened (see the module: what raises, what waits)."""
    check_store_name(store)
    index = DenseIndex(
        store, dsn=dsn, fingerprint=fingerprint, connect_timeout=connect_timeout, retry_interval=retry_interval
    )
    return index.open()


def _published_meta(conn: psycopg.Connection[Any], store: str, *, fingerprint: str | None) -> dense_db.DenseMeta:
    row = conn.execute(
        "SELECT id, tokenizer_fingerprint FROM crest_stores"
        " WHERE name = %s AND tier = 'static' AND state = 'published'",
        (store,),
    ).fetchone()
    if row is None:
        raise StoreNotFound(f"no published store named {store!r}")
    if fingerprint is not None and row[1] != fingerprint:
        raise FingerprintMismatch(f"store {store!r} was built with another tokenizer than the model's")
    try:
        meta = dense_db.read_meta(conn, int(row[0]))
    except psycopg.errors.UndefinedTable:
        meta = None  # a database migrated before dense parts existed
    if meta is None:
        raise ConfigError(
            f"store {store!r} has no dense part: build one with `crest ingest ... --store {store} --dense-model MODEL`"
        )
    return meta
