"""`Learner`: a bounded, batched, background appender of served token sequences into one store's learned log.

`learn(token_ids)` only copies the ids into an in-memory queue and returns: it never blocks on the database and
never raises. A daemon thread writes what is queued once its oldest sequence has waited `flush_interval` seconds, or
as soon as `flush_tokens` tokens wait, as ONE multi-row INSERT into `crest_learned` (`crest_client._learned_rows`:
token ids as little-endian uint32 bytes, a sequence's figures `STATS` and dense vectors `DENSE` when given) in a
transaction on its own connection, opened lazily, which also notifies `LEARNED_CHANNEL` (payload: the store) at its
COMMIT, so a replica's feed reads the rows at once instead of at its next poll. The queue holds at most
`max_pending_tokens` tokens; beyond that the oldest sequences are dropped and counted (the live tier keeps the most
recent outputs, so the newest are the ones worth keeping). A batch that no writable server took (down, restarting, a
failover under way, a standby that answers read-only, a timeout) goes back to the front of the queue and is tried
again, after `retry_interval` seconds doubling up to `max_retry_interval` while it fails, and written once a
writable server answers; a batch the database refuses (a schema it lacks) is dropped and counted; one warning per
outage. Each row is written at most once, and exactly once while the server it was sent to, or a replica promoted in
its place, keeps its history: the transaction's id (`pg_current_xact_id()`) is read before the INSERT, so when the
connection dies after the COMMIT was sent the batch keeps it, and once a server answers `pg_xact_status` says
whether it committed (counted written), aborted or never reached that server (written again) or is still running
(asked again later). It can still be lost, not doubled: a failover that loses the old primary's last commits
(asynchronous replication) while the promoted server reuses that id for a transaction of its own that commits, or an
id too old for the server to know (both taken as written or dropped, never retried). `flush()` waits until
everything queued so far is written or dropped and returns False on timeout (with no writable server, it times out);
`close()` keeps trying for at most its `timeout`, then drops what is left (counted) and stops the thread; learners
still open when the interpreter exits are closed then, at most `EXIT_TIMEOUT` seconds each. In a child made by
`os.fork()` a learner starts empty (the parent writes what it had queued) on a connection of its own, its thread
starts at its first use there, and a `multiprocessing` child writes what it learned as it ends
(`crest_client._fork`).
"""

from __future__ import annotations

import atexit
import logging
import math
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import psycopg

from crest_client._fork import at_child_exit, renew_in_child
from crest_client._learned_rows import (
    DENSE,
    LEARNED_CHANNEL,
    STATS,
    CommitUnknown,
    DenseRows,
    Item,
    fitting,
    insert_batch,
    split_stats,
    transaction_status,
)
from crest_client.names import check_store_name, resolve_dsn

__all__ = ["DENSE", "EXIT_TIMEOUT", "LEARNED_CHANNEL", "STATS", "DenseRows", "Learner", "split_stats"]

log = logging.getLogger(__name__)

EXIT_TIMEOUT = 5.0  # seconds an open learner may take to write its queue when the interpreter exits

IDLE_WAIT = 1.0  # seconds an idle writer sleeps between looks at its queue (a queued sequence wakes it at once)

Counter = Callable[[int, int], None]  # (rows, tokens)

_OPEN: weakref.WeakSet[Learner] = weakref.WeakSet()

# failures of a write that another try may not meet: no server, a lost connection, a timeout, a read-only standby
_RETRIED = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.ReadOnlySqlTransaction)


class Learner:
    """Appends served token sequences of one store to `crest_learned` from a background thread."""

    def __init__(
        self,
        dsn: str | None,
        store: str,
        *,
        source: str = "sdk",
        max_pending_tokens: int = 1_000_000,
        flush_interval: float = 1.0,
        flush_tokens: int = 65_536,
        connect_timeout: float = 2.0,
        statement_timeout: float = 5.0,
        retry_interval: float = 0.1,
        max_retry_interval: float = 5.0,
        on_written: Counter | None = None,
        on_dropped: Counter | None = None,
    ) -> None:
        self.store = check_store_name(store)
        self.source = source
        self.max_pending_tokens = max(1, int(max_pending_tokens))
        self.flush_interval = max(0.001, float(flush_interval))
        self.flush_tokens = max(1, int(flush_tokens))
        self.retry_interval = max(0.001, float(retry_interval))
        self.max_retry_interval = max(self.retry_interval, float(max_retry_interval))
        self._dsn = resolve_dsn(dsn)
        self._connect_timeout = max(1, math.ceil(connect_timeout))
        self._statement_ms = max(1, int(statement_timeout * 1000))
        self._on_written, self._on_dropped = on_written, on_dropped
        self._inherited: list[psycopg.Connection[Any]] = []  # in a forked child: the parent's, never used nor closed
        self._closing = False
        self._forked = False  # made in a forked child: writes what it learned as the child ends
        self._give_up_at = math.inf  # once closing: when what is still queued is dropped
        self._renew()
        self._wake()
        _OPEN.add(self)
        renew_in_child(self)

    def _renew(self) -> None:
        """Start with an empty queue, counters at 0, a fresh lock, no connection and no writer thread."""
        self._queue: deque[Item] = deque()
        self._queued_tokens = 0
        self._inflight: int | None = None  # seq of the first item of the batch being written
        self._inflight_size = (0, 0)  # its rows and tokens
        self._seq = 0
        self._cond = threading.Condition(threading.Lock())
        self._now = False  # write without waiting for the interval (a flush() or close() asked)
        self._conn: psycopg.Connection[Any] | None = None
        self._failing = False  # warned about the current outage
        self._thread: threading.Thread | None = None
        self._stats = {"written_rows": 0, "written_tokens": 0, "dropped_rows": 0, "dropped_tokens": 0, "errors": 0}

    def after_fork(self) -> None:
        """In a forked child: leave the parent its queue and connection; start empty, the thread at the first use."""
        if self._conn is not None:
            self._inherited.append(self._conn)  # the parent's session: closing it here would end it there
        self._renew()
        self._forked = True

    @property
    def stats(self) -> dict[str, int]:
        """Return the counters: queued rows and tokens, rows and tokens written and dropped, failed attempts."""
        with self._cond:
            rows, tokens = self._inflight_size  # being written: still queued until it is written or dropped
            return {"queued": len(self._queue) + rows, "queued_tokens": self._queued_tokens + tokens, **self._stats}

    def learn(
        self,
        token_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        prompt_tokens: int = 0,
        stats: Mapping[str, int] | None = None,
        dense: DenseRows | None = None,
    ) -> None:
        """Queue one served sequence (its first `prompt_tokens` ids are context); never block, never raise.

        `stats` holds the request's figures by `STATS` name (others are 0) and `accepted_<part>` per drafter
        part (`split_stats`); a sequence with unknown names or values that are not integers in 0..2**31-1 is
        dropped and counted, as bad ids are. `dense` holds its positions' dense vectors; vectors that do not fit
        the sequence (positions outside it, not one [n, dims] array) are left out and the sequence kept.
        """
        try:
            ids = np.asarray(token_ids)
            if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or int(ids.min()) < 0)):
                raise ValueError("token ids must be one sequence of non-negative integers")
            if ids.size and int(ids.max()) > 0xFFFFFFFF:
                raise ValueError("token ids must fit in 32 bits")
            data = ids.astype("<u4").tobytes()
            figures = None if stats is None else split_stats(stats)
        except Exception as exc:  # a caller's bad input is dropped and counted, never raised into serving
            n = len(token_ids) if hasattr(token_ids, "__len__") else 0
            log.debug("learner %s: dropped a sequence: %s", self.store, exc)
            self._drop(1, n)
            return
        n = int(ids.size)
        if n == 0:
            return
        item = Item(0, data, n, min(max(0, int(prompt_tokens)), n), figures, fitting(dense, n),
                    queued_at=time.monotonic())  # fmt: skip
        dropped_rows = dropped_tokens = 0
        with self._cond:
            if self._closing or n > self.max_pending_tokens:
                dropped_rows, dropped_tokens = 1, n
            else:
                self._wake()
                self._seq += 1
                item.seq = self._seq
                idle = not self._queue
                self._queue.append(item)
                self._queued_tokens += n
                dropped_rows, dropped_tokens = self._trim()
                if idle or self._queued_tokens >= self.flush_tokens:  # the writer's wait starts from this sequence
                    self._cond.notify_all()
        if dropped_rows:
            self._drop(dropped_rows, dropped_tokens)

    def flush(self, *, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written or dropped; return False on timeout."""
        with self._cond:
            target = self._seq
            self._wake()
            self._now = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._settled(target) or not self._writing(), timeout)

    def close(self, *, timeout: float | None = 10.0) -> None:
        """Write what is queued, trying for at most `timeout` seconds (None: however long), drop the rest, stop."""
        with self._cond:
            end = math.inf if timeout is None else time.monotonic() + max(0.0, timeout)
            self._give_up_at = min(self._give_up_at, end)
            self._closing = self._now = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        _OPEN.discard(self)

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _wake(self) -> None:
        """Start the writer thread unless it runs or the learner is closing (the caller holds the lock, or none yet)."""
        if self._thread is not None or self._closing:
            return
        self._thread = threading.Thread(target=self._run, name=f"crest-learner-{self.store}", daemon=True)
        self._thread.start()
        if self._forked:
            at_child_exit(self, "close")  # multiprocessing's children end with os._exit: no atexit

    def _writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _settled(self, target: int) -> bool:
        first_queued = self._queue[0].seq if self._queue else math.inf
        first_inflight = self._inflight if self._inflight is not None else math.inf
        return min(first_queued, first_inflight) > target

    def _trim(self) -> tuple[int, int]:
        """Drop the oldest sequences while more than `max_pending_tokens` wait; return the rows and tokens dropped."""
        rows = tokens = 0
        while self._queued_tokens > self.max_pending_tokens:  # oldest first: the window keeps the newest
            old = self._queue.popleft()
            self._queued_tokens -= old.n_tokens
            rows, tokens = rows + 1, tokens + old.n_tokens
        return rows, tokens

    def _run(self) -> None:
        delay = 0.0  # seconds to wait before the next try after a failed one; 0 while writes succeed
        try:
            while True:
                with self._cond:
                    if delay:  # backing off: a flush() or close() tries again at once
                        self._cond.wait_for(
                            lambda: self._now, max(0.0, min(delay, self._give_up_at - time.monotonic()))
                        )
                    else:
                        self._await_due()
                    batch = list(self._queue)
                    self._queue.clear()
                    self._queued_tokens = 0
                    self._inflight = batch[0].seq if batch else None
                    self._inflight_size = (len(batch), sum(item.n_tokens for item in batch))
                    self._now = False
                again = self._attempt(batch) if batch else []
                with self._cond:
                    self._queue.extendleft(reversed(again))  # back at the front: older than what came meanwhile
                    self._queued_tokens += sum(item.n_tokens for item in again)
                    dropped = self._trim()
                    self._inflight, self._inflight_size = None, (0, 0)
                    done = self._closing and (not self._queue or time.monotonic() >= self._give_up_at)
                    if done:  # closing: what could not be written in time is dropped
                        dropped = (dropped[0] + len(self._queue), dropped[1] + self._queued_tokens)
                        self._queue.clear()
                        self._queued_tokens = 0
                    self._cond.notify_all()
                if dropped[0]:
                    self._drop(*dropped)
                if done:
                    return
                delay = min(2 * delay or self.retry_interval, self.max_retry_interval) if again else 0.0
                delay *= random.uniform(0.75, 1.0)  # servers that lost the database do not all come back at once
        finally:
            self._disconnect()
            with self._cond:
                self._cond.notify_all()

    def _due(self) -> bool:
        return self._now or self._closing or self._queued_tokens >= self.flush_tokens

    def _await_due(self) -> None:
        """Wait (holding the lock) until the oldest queued sequence has waited `flush_interval`, or a write is due."""
        while not self._due():
            if not self._queue:  # idle: a learn(), flush() or close() wakes the thread
                if self._cond.wait(IDLE_WAIT) and self._queue:
                    continue
                return
            left = self._queue[0].queued_at + self.flush_interval - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _attempt(self, batch: list[Item]) -> list[Item]:
        """Write a batch (settling first the transaction that may have written its front); return what to retry."""
        unsure = [item for item in batch if item.xid is not None]  # the front of the queue: one transaction's
        rest = batch[len(unsure) :]
        try:
            conn = self._connection()
            if unsure:
                status = transaction_status(conn, unsure[0].xid or "")
                if status == "in progress":  # its COMMIT is still being done: ask again later
                    return batch
                if status == "committed":
                    self._written(unsure)
                elif status == "aborted":  # or never reached this server: write it again
                    for item in unsure:
                        item.xid = None
                    rest = unsure + rest
                else:  # too old to know: at most once, so never written again
                    log.warning("learner %s: %d rows may not have been written (unknown outcome)", self.store,
                                len(unsure))  # fmt: skip
                    self._drop(len(unsure), sum(item.n_tokens for item in unsure))
                unsure = []
            if rest:
                insert_batch(conn, rest, self.store, self.source)
                self._written(rest)
        except CommitUnknown as exc:
            self._failed(exc.__cause__ or exc, retry=True)
            for item in rest:
                item.xid = exc.xid
            return rest
        except Exception as exc:  # no writable server (retried), or refused (dropped)
            retry = isinstance(exc, _RETRIED)
            self._failed(exc, retry=retry)
            if retry:
                return unsure + rest
            self._drop(len(rest), sum(item.n_tokens for item in rest))  # refused: trying again would not help
            return unsure
        if self._failing:
            self._failing = False
            log.info("learner %s: writing learned tokens again", self.store)
        return []

    def _failed(self, exc: BaseException, *, retry: bool) -> None:
        """Count a failed attempt and warn once per outage; a connection that failed is not used again."""
        if retry:
            self._disconnect()
        with self._cond:
            self._stats["errors"] += 1
        if not self._failing:
            self._failing = True
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if retry:
                log.warning("learner %s: cannot write, keeping learned tokens until it can: %s", self.store, reason)
            else:
                log.warning("learner %s: the database refused learned tokens, dropping them: %s", self.store, reason)

    def _written(self, items: list[Item]) -> None:
        rows, tokens = len(items), sum(item.n_tokens for item in items)
        with self._cond:
            self._stats["written_rows"] += rows
            self._stats["written_tokens"] += tokens
        if self._on_written is not None:
            self._call(self._on_written, rows, tokens)

    def _drop(self, rows: int, tokens: int) -> None:
        with self._cond:
            self._stats["dropped_rows"] += rows
            self._stats["dropped_tokens"] += tokens
        if self._on_dropped is not None:
            self._call(self._on_dropped, rows, tokens)

    def _call(self, counter: Counter, rows: int, tokens: int) -> None:
        try:
            counter(rows, tokens)
        except Exception as exc:
            log.debug("learner %s: a counter callback failed: %s", self.store, exc)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            idle_ms = 2 * self._statement_ms  # a session whose client vanished mid-transaction ends on the server
            self._conn = psycopg.connect(
                self._dsn,
                autocommit=True,
                connect_timeout=self._connect_timeout,
                options=f"-c statement_timeout={self._statement_ms} -c idle_in_transaction_session_timeout={idle_ms}",
            )
        return self._conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:
                log.debug("learner %s: closing its connection: %s", self.store, exc)


@atexit.register
def _close_open_learners() -> None:
    for learner in list(_OPEN):
        learner.close(timeout=EXIT_TIMEOUT)
