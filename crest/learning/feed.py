"""The feed from the learned log into each process's recent tier: what any replica served, here within a second.

A `LearnedFeed` thread warms every store it is given with the store's last learned tokens (what the fleet served
before this process started: the database is the durable, shared record) and then polls `crest_learned` every
`interval` seconds for rows written since, by any process, adding each row (a document: its prompt's tail, then its
output) to the store's in-memory index. Between polls it listens on the primary (`listen_dsn`: standbys cannot
LISTEN) for the NOTIFY a learner sends with every batch it commits (`LEARNED_CHANNEL`), and polls as soon as one
names a store it feeds: another replica's answer is draftable here a few milliseconds after it is written, not up to
an interval later. Without a listening connection (not asked to listen, or the primary does not answer: tried again
every `LISTEN_RETRY` seconds) it polls on the interval alone. Rows this process wrote itself (`source`) are skipped:
they were added when they were learned. Identity ids are handed out at INSERT and rows become visible at COMMIT, so
ids can appear out of order: each poll also looks `LOOKBACK` ids back and skips the ids it already took. One indexed
statement per store per poll, on the read DSN (a replica serves it). A database that is down costs the feed its
polls, never an error: it reconnects and goes on from the last id it took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
import psycopg
from crest_client.hosts import resolve_read_dsn
from crest_client.learner import LEARNED_CHANNEL
from crest_client.names import resolve_dsn

from crest.config import DEFAULT_FEED_INTERVAL

log = logging.getLogger(__name__)

LOOKBACK = 1024  # ids below the newest taken that are looked at again (rows committed out of id order)
_BATCH = 2000  # rows a poll takes at most per store

LISTEN_RETRY = 30.0  # seconds between tries to listen again after the listening connection failed

WAKE_SLICE = 0.1  # seconds a wait for a notification lasts at most before it looks at `wake` and `stop`


class Documents(Protocol):
    """What the feed fills: anything that takes a document of token ids (a `RecentIndex`)."""

    @property
    def options(self) -> Any: ...

    def add(self, tokens: np.ndarray) -> None: ...


class _Cursor:
    """Where one store's feed stands: the newest id taken and the ids taken within LOOKBACK of it."""

    def __init__(self) -> None:
        self.newest = 0
        self.taken: set[int] = set()
        self.warmed = False

    def take(self, sid: int) -> None:
        self.taken.add(sid)
        self.newest = max(self.newest, sid)
        if len(self.taken) > 2 * LOOKBACK:
            self.taken = {i for i in self.taken if i > self.newest - LOOKBACK}


class LearnedFeed:
    """A thread that warms and feeds each store's recent index from the learned log; it never raises."""

    def __init__(
        self,
        dsn: str | None,
        indexes: Callable[[], Iterable[tuple[str, Documents]]],
        *,
        source: str = "",
        interval: float = DEFAULT_FEED_INTERVAL,
        warm_tokens: int | None = None,
        connect_timeout: float = 2.0,
        listen: bool = False,
        listen_dsn: str | None = None,
    ) -> None:
        """`dsn`: where it polls (a replica may serve it); with `listen`, the notifications of the primary the
        learners write to (`listen_dsn`, resolved as theirs is) wake it, else it polls on the interval alone."""
        self.dsn, self.indexes, self.source = dsn, indexes, source
        self.listen, self.listen_dsn = listen, listen_dsn
        self._listen: psycopg.Connection[Any] | None = None
        self._listen_at = 0.0  # time.monotonic() from which a listening connection may be tried again
        self.interval, self.warm_tokens, self.connect_timeout = float(interval), warm_tokens, connect_timeout
        self.counts = {"polls": 0, "rows": 0, "tokens": 0, "failed": 0, "notified": 0}
        self._cursors: dict[str, _Cursor] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> None:
        """Start polling in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="crest-learned-feed", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Poll now (a store was just opened: warm it without waiting for the interval)."""
        self._wake.set()

    def stop(self, *, timeout: float | None = 10.0) -> None:
        """Stop the thread after the poll in progress and close its connection."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for conn in (self._conn, self._listen):
            if conn is not None:
                conn.close()

    def poll(self) -> int:
        """Warm stores not warmed yet and add rows written since the last poll; return rows added."""
        added = 0
        for name, index in list(self.indexes()):
            cursor = self._cursors.setdefault(name, _Cursor())
            conn = self._connection()
            if not cursor.warmed:
                added += self._warm(conn, name, index, cursor)
                cursor.warmed = True
            added += self._fresh(conn, name, index, cursor)
        self.counts["polls"] += 1
        return added

    def _warm(self, conn: psycopg.Connection[Any], name: str, index: Documents, cursor: _Cursor) -> int:
        """Add the store's last learned rows, up to the index's capacity in tokens, oldest first."""
        budget = self.warm_tokens if self.warm_tokens is not None else int(index.options.capacity)
        rows: list[np.ndarray] = []
        total, below = 0, 2**63 - 1
        while total < budget:  # newest first, a page at a time (no server cursor to leave open if the link drops)
            page = conn.execute(
                "SELECT id, tokens, source FROM crest_learned WHERE store = %s AND id < %s ORDER BY id DESC LIMIT %s",
                (name, below, _BATCH),
            ).fetchall()
            conn.commit()
            for sid, data, source in page:
                cursor.take(int(sid))
                if source != self.source and total < budget:
                    tokens = np.frombuffer(bytes(data), dtype="<u4").astype(np.int64)
                    rows.append(tokens)
                    total += len(tokens) + 1
            if len(page) < _BATCH:
                break
            below = int(page[-1][0])
        for tokens in reversed(rows):
            index.add(tokens)
        self._count(len(rows), total)
        if rows:
            log.info("store %r: recent tier warmed with %d learned rows (%d tokens)", name, len(rows), total)
        return len(rows)

    def _fresh(self, conn: psycopg.Connection[Any], name: str, index: Documents, cursor: _Cursor) -> int:
        """Add the rows written since the newest id taken (and any committed late within LOOKBACK of it)."""
        floor = max(0, cursor.newest - LOOKBACK)
        taken = [i for i in cursor.taken if i > floor]
        found = conn.execute(
            "SELECT id, tokens, source FROM crest_learned WHERE store = %s AND id > %s AND id <> ALL(%s)"
            " ORDER BY id LIMIT %s",
            (name, floor, taken, _BATCH),
        ).fetchall()
        conn.commit()
        added = tokens_added = 0
        for sid, data, source in found:
            cursor.take(int(sid))
            if source == self.source:
                continue
            tokens = np.frombuffer(bytes(data), dtype="<u4").astype(np.int64)
            index.add(tokens)
            added, tokens_added = added + 1, tokens_added + len(tokens)
        self._count(added, tokens_added)
        return added

    def _count(self, rows: int, tokens: int) -> None:
        self.counts["rows"] += rows
        self.counts["tokens"] += tokens

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                resolve_read_dsn(self.dsn), connect_timeout=max(1, round(self.connect_timeout)),
                application_name="crest-feed", options="-c statement_timeout=5000",
            )  # fmt: skip
        return self._conn

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self._warned = False
            except Exception as exc:  # a database that is down or slow costs polls, never the server
                self.counts["failed"] += 1
                level = logging.DEBUG if self._warned else logging.WARNING
                log.log(level, "the learned feed could not poll (retrying): %s", str(exc).strip().splitlines()[0])
                self._warned = True
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            self._await(self.interval)
            self._wake.clear()

    def _await(self, timeout: float) -> None:
        """Wait until a learner notifies a batch of a store fed here, `timeout` passes, or `wake`/`stop` is called."""
        end = time.monotonic() + timeout
        while not self._wake.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            listen = self._listener()
            if listen is None:
                self._wake.wait(left)
                return
            try:
                names = {name for name, _ in self.indexes()}
                for note in listen.notifies(timeout=min(left, WAKE_SLICE)):
                    if note.payload in names:
                        self.counts["notified"] += 1
                        return
            except Exception as exc:  # the primary went away: poll on the interval until it answers again
                log.debug("the learned feed stopped listening (polling on its interval): %s", exc)
                listen.close()
                self._listen, self._listen_at = None, time.monotonic() + LISTEN_RETRY

    def _listener(self) -> psycopg.Connection[Any] | None:
        """Return the connection listening for learned batches (made at need; None: none given, or not now)."""
        if self._listen is not None and not self._listen.closed:
            return self._listen
        if not self.listen or time.monotonic() < self._listen_at:
            return None
        conn = None
        try:
            conn = psycopg.connect(resolve_dsn(self.listen_dsn), autocommit=True, application_name="crest-feed-listen",
                                   connect_timeout=max(1, round(self.connect_timeout)))  # fmt: skip
            conn.execute(f"LISTEN {LEARNED_CHANNEL}")
        except Exception as exc:  # down, or a standby (no LISTEN in recovery): the interval alone, for a while
            log.debug("the learned feed cannot listen (polling on its interval): %s", exc)
            if conn is not None:
                conn.close()
            self._listen_at = time.monotonic() + LISTEN_RETRY
            return None
        self._listen = conn
        return conn
