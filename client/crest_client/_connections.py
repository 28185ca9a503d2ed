"""The SDK's connections to one database: a psycopg pool whose connections stay out of it between lookups.

`open_pool` opens the pool a `Store` reads through (a plain first attempt, so a database that is down fails at once
with its reason; `statement_timeout` set to the lookup timeout on every connection). `Connections` lends its
connections: kept ones first, another from the pool while fewer than its size are out (a pool check-out costs
10-25 us), a failed one handed back so the pool replaces it. `run_prepared` runs a prepared statement on libpq
directly (psycopg's cursor layer costs ~40 us) and waits for its result until the lookup timeout on the client's
clock; past it the statement is cancelled and the connection kept (a server that is only slow), or closed when the
server does not answer the cancel either (one that stopped answering). When the pool gives no connection within a
lookup's timeout (the database is down or restarting), the lookups of the next `DOWN_REST` seconds fail at once,
so an engine's steps are not each held for a timeout while it is gone; then one waits again. In a child made by
`os.fork()` the handle reads through a pool of its own, opened at its first lookup: the parent's connections are
left to the parent, never used nor closed there (`register_at_fork`). While the machine has an idle CPU, a lookup
first busy-polls for its answer for up to `spin` seconds (`SPIN`, 200 us): a client asleep in select wakes 20-40 us
after its answer arrives on an idle virtual machine, a quarter of a lookup. On a busy machine (load average
at or above the CPU count, re-read once a second) it sleeps at once: there the poll would take CPU from the server.
A private module with public names: `Store` is built on it.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool, PoolTimeout

from crest_client.errors import ConnectionUnavailable, CrestClientError
from crest_client.lookup import check_result

POOL_PREFIX = "crest-client-"  # the names of the SDK's pools, whose failures `Store` reports itself, once

SPIN = 0.0002  # seconds a lookup busy-polls for its answer while a CPU is idle, before it sleeps in select
LOOKUP_TIMEOUT = 0.01  # seconds a lookup may take: the server's statement_timeout and the client's clock
# seconds after the pool found no connection within a lookup's timeout (a database down or restarting) during which
# lookups fail at once instead of each waiting its timeout again: a step of an engine drafts without the store then
DOWN_REST = 1.0
ENV_LOOKUP_TIMEOUT = "CREST_LOOKUP_TIMEOUT"  # seconds, for handles that do not pass `timeout`
ENV_LOOKUP_SPIN = "CREST_LOOKUP_SPIN"  # seconds, for handles that do not pass `spin` (0: always sleep)


MAX_SECONDS = (2**31 - 1) / 1000  # PostgreSQL's statement_timeout is at most INT_MAX milliseconds


def resolve_seconds(value: float | None, *, env: str, default: float, zero: bool = True, arg: str = "seconds") -> float:
    """Return `value`, else the seconds the environment variable `env` holds, else `default`; raise on a bad one."""
    if value is not None:
        return check_seconds(value, name=arg, zero=zero)
    text = os.environ.get(env, "").strip()
    return check_seconds(text, name=env, zero=zero) if text else default


def check_seconds(value: float | str, *, name: str, zero: bool = True, most: float = MAX_SECONDS) -> float:
    """Return `value` as seconds; raise CrestClientError unless it is > 0 (or 0 with `zero`) and at most `most`."""
    try:
        seconds = float(value)  # a string from the environment, or a number
    except (TypeError, ValueError):
        seconds = math.nan
    if not ((seconds > 0 or (zero and seconds == 0)) and seconds <= most):  # NaN fails both
        raise CrestClientError(
            f"{name} must be a number of seconds {'>=' if zero else '>'} 0 and at most {most}, got {value!r}"
        )
    return seconds


def open_pool(dsn: str, name: str, *, timeout: float, pool_size: int, connect_timeout: float) -> ConnectionPool:
    """Open the pool of store `name`'s readers; raise ConnectionUnavailable (with the reason) when none connects."""
    try:  # one plain attempt first: a down database fails at once, with its reason, and no pool retries
        psycopg.connect(dsn, connect_timeout=max(2, math.ceil(connect_timeout))).close()
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise ConnectionUnavailable(f"cannot connect to the crest database for store {name!r}: {reason}") from None
    pool = new_pool(dsn, f"{POOL_PREFIX}{name}", timeout=timeout, pool_size=pool_size, connect_timeout=connect_timeout)
    try:
        pool.open(wait=True, timeout=connect_timeout)
    except PoolTimeout:
        pool.close()
        raise ConnectionUnavailable(f"cannot connect to the crest database for store {name!r}") from None
    return pool


def new_pool(
    dsn: str | Callable[[], str], name: str, *, timeout: float, pool_size: int, connect_timeout: float
) -> ConnectionPool:
    """Return a pool (not yet open) of connections whose statements time out after `timeout` seconds."""
    timeout_ms = max(1, int(timeout * 1000))

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.execute(f"SET statement_timeout = {timeout_ms}")
        conn.commit()

    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=max(1, pool_size),
        open=False,
        configure=configure,
        kwargs={"autocommit": True, "prepare_threshold": 0, "application_name": "crest-client"},
        timeout=connect_timeout,
        reconnect_timeout=0,
        name=name,
    )


def check_max_nodes(max_nodes: int) -> int:
    """Return `max_nodes` when it is a whole number (below 1: no draft, 0); raise CrestClientError otherwise."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, numbers.Integral):
        raise CrestClientError(f"max_nodes must be a whole number, got {max_nodes!r}")
    return max(0, int(max_nodes))


class LookupTimeout(psycopg.OperationalError):
    """The server did not answer a lookup within the handle's timeout (statement cancelled, or connection closed)."""


class Connections:
    """Lends a pool's connections for lookups, each bounded by the lookup timeout."""

    def __init__(self, pool: ConnectionPool, *, timeout: float, spin: float = SPIN) -> None:
        self.pool = pool
        self.timeout = float(timeout)
        self.spin = max(0.0, min(float(spin), self.timeout))
        self.polled = 0  # answers that arrived while their lookup polled
        self._rest_until = 0.0  # monotonic time before which `take` fails at once: the pool had no connection
        self._unopened = False  # a pool made in a forked child, opened at its first lookup
        self._inherited: list[ConnectionPool] = []  # in a forked child: the parents' pools, never closed here
        self._start()
        _ALL.add(self)

    def _start(self) -> None:
        self._idle: list[psycopg.Connection[Any]] = []  # connections kept out of the pool for lookups
        self._out = 0  # connections taken from the pool: idle or in use
        self._kept = threading.Condition(threading.Lock())
        self._lock = threading.Lock()
        self._prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()

    def after_fork(self) -> None:
        """In a forked child: leave the parent's pool and connections alone and read through a new pool.

        The parent's connections are its sessions: a child that used one would interleave its statements with the
        parent's, and one that closed it would end the parent's session. They are kept, unused and unclosed (a
        connection of another process is never finished when collected either), and a pool with the same options
        opens at the child's first lookup (its threads start then, not in the fork handler).
        """
        old = self.pool
        if old.closed and not self._unopened:  # a handle closed before the fork stays closed
            return
        self._inherited.append(old)
        self.pool = new_pool(old.conninfo, old.name, timeout=self.timeout, pool_size=old.max_size,
                             connect_timeout=old.timeout)  # fmt: skip
        self._unopened = True
        self._start()  # the parent's locks may have been held by one of its threads at the fork

    def take(self) -> psycopg.Connection[Any]:
        """Take a kept connection, or one more from the pool while fewer than its size are out."""
        now = time.monotonic()
        deadline = now + self.timeout
        if now < self._rest_until:  # the pool found no connection a moment ago: do not wait for one again yet
            raise PoolTimeout(f"the database gave no connection within {self.timeout:g} s lately; resting")
        if self._unopened:
            self._open_pool()
        with self._kept:
            while not self._idle:
                if self._out < self.pool.max_size:
                    self._out += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._kept.wait(left):
                    raise PoolTimeout(f"no connection free within {self.timeout:g} s")
            else:
                return self._idle.pop()
        try:
            conn = self.pool.getconn(timeout=self.timeout)
        except BaseException as exc:
            if isinstance(exc, PoolTimeout):  # a database that is down: the next lookups within DOWN_REST fail at once
                self._rest_until = time.monotonic() + DOWN_REST
            self.drop(None)
            raise
        self._rest_until = 0.0
        return conn

    def _open_pool(self) -> None:
        """Open the pool made after a fork (without waiting: the lookup waits for a connection, bounded as ever)."""
        with self._lock:
            if self._unopened:
                self.pool.open(wait=False)
                self._unopened = False

    def keep(self, conn: psycopg.Connection[Any]) -> None:
        """Keep a connection that served a statement for the next one."""
        with self._kept:
            self._idle.append(conn)
            self._kept.notify()

    def drop(self, conn: psycopg.Connection[Any] | None) -> None:
        """Hand a connection that failed back to the pool, which replaces it if it is broken."""
        if conn is not None:
            self.pool.putconn(conn)
        with self._kept:
            self._out -= 1
            self._kept.notify()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a kept connection for a statement."""
        conn = self.take()
        try:
            yield conn
        except BaseException:
            self.drop(conn)
            raise
        self.keep(conn)

    def run_prepared(self, name: bytes, query: bytes, types: Sequence[int], values: Sequence[bytes]) -> Any:
        """Run prepared statement `name` (prepared from `query` on first use per connection) with binary values."""
        conn = self.take()
        try:
            prepared = self._prepared.get(conn)
            if prepared is None:
                with self._lock:
                    prepared = self._prepared.setdefault(conn, set())
            pgconn = conn.pgconn
            if name not in prepared:
                check_result(pgconn.prepare(name, query, list(types)))
                prepared.add(name)
            pgconn.send_query_prepared(name, list(values), param_formats=[1] * len(values), result_format=1)
            res = check_result(self.wait(conn))
        except BaseException:
            self.drop(conn)
            raise
        self.keep(conn)
        return res

    def run_params(self, query: bytes, values: Sequence[bytes]) -> Any:
        """Run an unprepared statement with text values; return its libpq result."""
        with self.connection() as conn:
            conn.pgconn.send_query_params(query, list(values))
            return check_result(self.wait(conn))

    def wait(self, conn: psycopg.Connection[Any]) -> Any:
        """Wait for the result of the query sent on `conn` until the lookup timeout; close `conn` past it.

        The server's statement_timeout bounds a slow query; this bounds a server that stopped answering: the
        connection is then closed (the pool replaces it) and the lookup fails.
        """
        pgconn = conn.pgconn
        deadline = time.monotonic() + self.timeout
        if self.spin and has_idle_cpu() and _SPINNING.acquire(blocking=False):
            try:  # spin <= timeout: the poll ends before the deadline
                end = time.monotonic() + self.spin
                while not pgconn.flush() and pgconn.is_busy() and time.monotonic() < end:
                    pgconn.consume_input()
                self.polled += not pgconn.is_busy()
            finally:
                _SPINNING.release()
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
                    kept = self.cancel(conn)
                    raise LookupTimeout(
                        f"no answer within {self.timeout:g} s; "
                        + ("statement cancelled" if kept else "connection closed")
                    )
                if ready[0]:
                    pgconn.consume_input()
            res = pgconn.get_result()
            if res is None:
                return result
            if result is None or res.status != pq.ExecStatus.TUPLES_OK:
                result = res

    def cancel(self, conn: psycopg.Connection[Any]) -> bool:
        """Cancel the statement still running on `conn` and drain it; close `conn` when that fails. Return if kept.

        A slow server (a lock, a loaded machine) answers the cancel at once and the connection, with its prepared
        statements, serves the next lookup: no reconnect when lookups run late. A server that stopped answering
        does not answer the cancel either: after another timeout's wait the connection is closed (the pool
        replaces it). libpq before 17 has no cancel with a timeout, so there the connection is closed at once.
        """
        try:
            if pq.version() < 170000:
                raise psycopg.OperationalError("libpq < 17: no bounded cancel")
            conn.cancel_safe(timeout=self.timeout)
            pgconn = conn.pgconn
            deadline = time.monotonic() + self.timeout
            while pgconn.flush() == 0 and pgconn.is_busy():
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([pgconn.socket], [], [], left)[0]:
                    raise psycopg.OperationalError("no answer to the cancel")
                pgconn.consume_input()
            while pgconn.get_result() is not None:
                pass  # the statement's error (cancelled), or its rows if they came first
            if pgconn.is_busy() or pgconn.transaction_status != pq.TransactionStatus.IDLE:
                raise psycopg.OperationalError("connection not idle after the cancel")
            return True
        except (psycopg.Error, OSError):
            conn.close()
            return False

    def close(self) -> None:
        """Hand the kept connections back and close the pool."""
        with self._kept:
            idle, self._idle = self._idle, []
            self._out -= len(idle)
        for conn in idle:
            self.pool.putconn(conn)
        self.pool.close()


def has_idle_cpu() -> bool:
    """Return whether this machine's load average leaves a CPU idle (re-read at most once a second)."""
    global _load_checked, _idle
    now = time.monotonic()
    if now - _load_checked > 1.0:
        _load_checked = now
        try:
            _idle = os.getloadavg()[0] < _CPUS
        except (AttributeError, OSError):  # no load average on this platform (Windows): never busy-poll
            _idle = False
    return _idle


_SPINNING = threading.Lock()  # one thread of a process polls at a time: more would take turns holding the GIL
_ALL: weakref.WeakSet[Connections] = weakref.WeakSet()  # every handle's connections, reopened in a forked child

_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_load_checked, _idle = -2.0, False


def _after_fork_in_child() -> None:
    """Give every handle of a forked child connections of its own (and a free poll lock)."""
    global _SPINNING
    _SPINNING = threading.Lock()  # a parent's thread may have held it at the fork
    for conns in list(_ALL):
        conns.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class OwnPoolRecords(logging.Filter):
    """Drops psycopg_pool's records about the SDK's pools: `Store` reports their failures itself, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(is_own_pool(arg) for arg in args)


def is_own_pool(value: object) -> bool:
    """Return whether `value` is one of the SDK's pools, its name, or a connection or task of one."""
    if isinstance(value, str):
        return value.startswith(POOL_PREFIX)
    pool = getattr(value, "_pool", None) or getattr(value, "pool", None) or value  # a connection, a task, a pool
    if isinstance(pool, weakref.ref):
        pool = pool()
    return str(getattr(pool, "name", "")).startswith(POOL_PREFIX)


logging.getLogger("psycopg.pool").addFilter(OwnPoolRecords())
