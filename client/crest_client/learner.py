"""`Learner`: a bounded, batched, background appender of served token sequences into one store's learned log.

`learn(token_ids)` only copies the ids into an in-memory queue and returns: it never blocks on the database
and never raises. A daemon thread writes what is queued every `flush_interval` seconds, or as soon as
`flush_tokens` tokens wait, as ONE multi-row INSERT into `crest_learned` (token ids as little-endian uint32
bytes) on its own connection, opened lazily and reopened after a failure. The queue holds at most
`max_pending_tokens` tokens; beyond that the oldest sequences are dropped (the live tier keeps the most recent
outputs, so the newest are the ones worth keeping). A database that is down, slow or refusing makes the thread
drop the batch it was writing (after one more try on a fresh connection when the connection failed or timed
out), count it and warn once per outage; the caller never waits for it. `flush()`
waits until everything queued so far is written or dropped; `close()` flushes and stops the thread (learners
still open when the interpreter exits are closed then, waiting at most `EXIT_TIMEOUT` seconds each). A
sequence may carry how its request went (`stats`: the integer columns named in `STATS`, and `accepted_<part>`
for any drafter part, kept in the jsonb column `accepted_parts`) and its positions' dense vectors (`DenseRows`,
the columns named in `DENSE`, schema 0007); a batch without any writes the columns of schema 0003 only, so a
database not yet upgraded still takes it.
"""

from __future__ import annotations

import atexit
import logging
import math
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg.types.json import Jsonb

from crest_client.names import check_store_name, resolve_dsn

log = logging.getLogger(__name__)

STATS = (
    "steps",  # target forwards
    "new_tokens",  # tokens generated
    "draft_tokens",  # draft nodes verified
    "accepted_tokens",  # draft nodes accepted
)  # a learned row's figures of the request that served it (0 when not given)

DENSE = (
    "dense_version",  # the static store version whose dense part projected the vectors
    "dense_first",  # the row position whose state is the first vector
    "dense",  # the vectors, float16 little-endian [n, dims]: vector i is the state at position dense_first + i
)  # a learned row's dense vectors (NULL when not given): a refresh builds the live tier's dense part from them

PART_PREFIX = "accepted_"  # stats["accepted_<part>"]: accepted tokens the part's tree held along the accepted path
PART_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")  # a drafter part's name: static, live, prompt, ...

INSERT_SQL = (
    "INSERT INTO crest_learned (store, tokens, n_tokens, prompt_tokens, source)"
    " SELECT %s, t, n, p, %s FROM unnest(%s::bytea[], %s::integer[], %s::integer[]) AS u(t, n, p)"
)

INSERT_STATS_SQL = (
    f"INSERT INTO crest_learned (store, tokens, n_tokens, prompt_tokens, source, {', '.join(STATS)}, accepted_parts)"
    f" SELECT %s, t, n, p, %s, {', '.join(STATS)}, a FROM unnest(%s::bytea[], %s::integer[], %s::integer[],"
    f" {', '.join(['%s::integer[]'] * len(STATS))}, %s::jsonb[]) AS u(t, n, p, {', '.join(STATS)}, a)"
)

INSERT_DENSE_SQL = (
    f"INSERT INTO crest_learned (store, tokens, n_tokens, prompt_tokens, source, {', '.join(STATS)}, accepted_parts,"
    f" {', '.join(DENSE)}) SELECT %s, t, n, p, %s, {', '.join(STATS)}, a, {', '.join(DENSE)} FROM unnest(%s::bytea[],"
    f" %s::integer[], %s::integer[], {', '.join(['%s::integer[]'] * len(STATS))}, %s::jsonb[], %s::integer[],"
    f" %s::integer[], %s::bytea[]) AS u(t, n, p, {', '.join(STATS)}, a, {', '.join(DENSE)})"
)

EXIT_TIMEOUT = 5.0  # seconds an open learner may take to write its queue when the interpreter exits

Counter = Callable[[int, int], None]  # (rows, tokens)

_OPEN: weakref.WeakSet[Learner] = weakref.WeakSet()


@dataclass
class _Item:
    """One queued sequence: its place in the queue's order, token bytes, counts and figures (`split_stats`)."""

    seq: int
    tokens: bytes
    n_tokens: int
    prompt_tokens: int
    stats: tuple[tuple[int, ...], dict[str, int]] | None = None
    dense: DenseRows | None = None


@dataclass(frozen=True)
class DenseRows:
    """A served sequence's dense vectors: vector i [dims] is the hidden state at position `first + i`, projected.

    `version` is the static store version whose dense part projected them (standardise, PCA, L2-normalise).
    """

    version: int
    first: int
    vectors: np.ndarray[Any, Any]  # [n, dims], stored as float16


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
        on_written: Counter | None = None,
        on_dropped: Counter | None = None,
    ) -> None:
        self.store = check_store_name(store)
        self.source = source
        self.max_pending_tokens = max(1, int(max_pending_tokens))
        self.flush_interval = max(0.001, float(flush_interval))
        self.flush_tokens = max(1, int(flush_tokens))
        self._dsn = resolve_dsn(dsn)
        self._connect_timeout = max(1, math.ceil(connect_timeout))
        self._statement_ms = max(1, int(statement_timeout * 1000))
        self._on_written, self._on_dropped = on_written, on_dropped
        self._queue: deque[_Item] = deque()
        self._queued_tokens = 0
        self._inflight: int | None = None  # seq of the first item of the batch being written
        self._seq = 0
        self._cond = threading.Condition(threading.Lock())
        self._now = False  # write without waiting for the interval (a flush() or close() asked)
        self._closing = False
        self._conn: psycopg.Connection[Any] | None = None
        self._failing = False  # warned about the current outage
        self._stats = {
            "written_rows": 0,
            "written_tokens": 0,
            "dropped_rows": 0,
            "dropped_tokens": 0,
            "errors": 0,
        }
        self._thread = threading.Thread(target=self._run, name=f"crest-learner-{store}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    @property
    def stats(self) -> dict[str, int]:
        """Return the counters: queued rows and tokens, rows and tokens written and dropped, write errors."""
        with self._cond:
            return {"queued": len(self._queue), "queued_tokens": self._queued_tokens, **self._stats}

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
        item = _Item(0, data, n, min(max(0, int(prompt_tokens)), n), figures, _fitting(dense, n))
        dropped_rows = dropped_tokens = 0
        with self._cond:
            if self._closing or n > self.max_pending_tokens:
                dropped_rows, dropped_tokens = 1, n
            else:
                self._seq += 1
                item.seq = self._seq
                self._queue.append(item)
                self._queued_tokens += n
                while self._queued_tokens > self.max_pending_tokens:  # oldest first: the window keeps the newest
                    old = self._queue.popleft()
                    self._queued_tokens -= old.n_tokens
                    dropped_rows, dropped_tokens = dropped_rows + 1, dropped_tokens + old.n_tokens
                if self._queued_tokens >= self.flush_tokens:
                    self._cond.notify_all()
        if dropped_rows:
            self._drop(dropped_rows, dropped_tokens)

    def flush(self, *, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written or dropped; return False on timeout."""
        with self._cond:
            target = self._seq
            self._now = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._settled(target) or not self._thread.is_alive(), timeout)

    def close(self, *, timeout: float | None = 10.0) -> None:
        """Write what is queued (waiting at most `timeout` seconds), stop the thread and close the connection."""
        with self._cond:
            self._closing = self._now = True
            self._cond.notify_all()
        self._thread.join(timeout)
        _OPEN.discard(self)

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _settled(self, target: int) -> bool:
        first_queued = self._queue[0].seq if self._queue else math.inf
        first_inflight = self._inflight if self._inflight is not None else math.inf
        return min(first_queued, first_inflight) > target

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._due, self.flush_interval)
                    batch = list(self._queue)
                    self._queue.clear()
                    self._queued_tokens = 0
                    self._inflight = batch[0].seq if batch else None
                    closing, self._now = self._closing, False
                if batch:
                    self._write(batch)
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()
                if closing:
                    return
        finally:
            self._disconnect()
            with self._cond:
                self._cond.notify_all()

    def _due(self) -> bool:
        return self._now or self._closing or self._queued_tokens >= self.flush_tokens

    def _write(self, batch: list[_Item]) -> None:
        rows, tokens = len(batch), sum(item.n_tokens for item in batch)
        columns = [[item.tokens for item in batch], [item.n_tokens for item in batch]]
        columns.append([item.prompt_tokens for item in batch])
        with_dense = any(item.dense is not None for item in batch)
        with_stats = with_dense or any(item.stats is not None for item in batch)
        if with_stats:
            figures = [item.stats or ((0,) * len(STATS), {}) for item in batch]
            columns.extend(list(column) for column in zip(*(values for values, _ in figures), strict=True))
            columns.append([Jsonb(parts) for _, parts in figures])
        if with_dense:
            dense = [item.dense for item in batch]
            columns.append([d.version if d is not None else None for d in dense])
            columns.append([d.first if d is not None else None for d in dense])
            columns.append([d.vectors.astype("<f2").tobytes() if d is not None else None for d in dense])
        query = INSERT_DENSE_SQL if with_dense else INSERT_STATS_SQL if with_stats else INSERT_SQL
        try:
            try:
                conn = self._connection()
                conn.execute(query, (self.store, self.source, *columns))
            except psycopg.OperationalError:  # a connection lost or a timeout on a loaded server: once more, afresh
                self._disconnect()
                conn = self._connection()
                conn.execute(query, (self.store, self.source, *columns))
        except Exception as exc:  # down, slow, restarting or refusing: this batch is lost, serving goes on
            self._disconnect()
            with self._cond:
                self._stats["errors"] += 1
            if not self._failing:
                self._failing = True
                reason = " ".join(str(exc).split()) or type(exc).__name__
                log.warning("learner %s: cannot write, dropping learned tokens until it can: %s", self.store, reason)
            self._drop(rows, tokens)
            return
        if self._failing:
            self._failing = False
            log.info("learner %s: writing learned tokens again", self.store)
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
            self._conn = psycopg.connect(
                self._dsn,
                autocommit=True,
                connect_timeout=self._connect_timeout,
                options=f"-c statement_timeout={self._statement_ms}",
            )
        return self._conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:
                log.debug("learner %s: closing its connection: %s", self.store, exc)


def _fitting(dense: DenseRows | None, n_tokens: int) -> DenseRows | None:
    """Return the dense vectors when they are [n, dims] states of positions inside a sequence of n_tokens, else None."""
    if dense is None:
        return None
    try:
        vectors = np.asarray(dense.vectors)
        first = int(dense.first)
        if vectors.ndim != 2 or not vectors.shape[0] or first < 0 or first + vectors.shape[0] > n_tokens:
            return None
        return DenseRows(int(dense.version), first, vectors)
    except Exception as exc:  # a caller's bad vectors are left out, the sequence is kept
        log.debug("dense vectors left out: %s", exc)
        return None


def split_stats(stats: Mapping[str, int]) -> tuple[tuple[int, ...], dict[str, int]]:
    """Return a request's figures in `STATS` order (missing ones 0) and its non-zero parts; raise ValueError."""
    parts = {
        name[len(PART_PREFIX) :]: value
        for name, value in stats.items()
        if name not in STATS and name.startswith(PART_PREFIX) and PART_NAME.fullmatch(name[len(PART_PREFIX) :])
    }
    unknown = set(stats) - set(STATS) - {PART_PREFIX + part for part in parts}
    if unknown:
        raise ValueError(
            f"unknown learned figures {sorted(unknown)}; known: {', '.join(STATS)} and"
            f" {PART_PREFIX}<part> (a part's name: lowercase letters, digits, _)"
        )
    values = tuple(_figure(name, stats.get(name, 0)) for name in STATS)
    return values, {part: n for part, value in sorted(parts.items()) if (n := _figure(PART_PREFIX + part, value))}


def _figure(name: str, value: object) -> int:
    """Return a figure as an int; raise ValueError unless it is an integer in 0..2**31-1."""
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = -1
    if not 0 <= number <= 0x7FFFFFFF:
        raise ValueError(f"learned figures must be integers in 0..2**31-1, got {name}={value!r}")
    return number


@atexit.register
def _close_open_learners() -> None:
    for learner in list(_OPEN):
        learner.close(timeout=EXIT_TIMEOUT)
