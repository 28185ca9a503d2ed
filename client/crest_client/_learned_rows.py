"""The rows a `crest_client.learner.Learner` appends to `crest_learned`: a queued sequence, its figures and vectors.

`Item` is one queued served sequence (token ids as little-endian uint32 bytes); `insert_statement` turns a batch of
them into ONE multi-row INSERT, the columns of schema 0003 only when no item carries figures (`STATS`, and
`accepted_<part>` in the jsonb column `accepted_parts`) or dense vectors (`DENSE`, schema 0007), so a database not
yet upgraded still takes it. `insert_batch` runs it in a transaction whose id it reads first, so that a COMMIT left
without an answer names the transaction (`CommitUnknown`) whose fate `transaction_status` asks the server later.
`split_stats` and `fitting` check what a caller hands `learn()`. A private module with
public names: `crest_client.learner` hands them on.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger("crest_client.learner")

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

LEARNED_CHANNEL = "crest_learned"  # NOTIFY channel of every learned batch (payload: its store), at its COMMIT

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


@dataclass
class Item:
    """One queued sequence: its place in the queue's order, token bytes, counts, figures (`split_stats`), vectors.

    `xid` names the transaction that may have written it (its COMMIT was sent, no answer came back), else None.
    """

    seq: int
    tokens: bytes
    n_tokens: int
    prompt_tokens: int
    stats: tuple[tuple[int, ...], dict[str, int]] | None = None
    dense: DenseRows | None = None
    xid: str | None = None
    queued_at: float = 0.0  # time.monotonic() when it was queued: it waits at most the learner's flush interval


@dataclass(frozen=True)
class DenseRows:
    """A served sequence's dense vectors: vector i [dims] is the hidden state at position `first + i`, projected.

    `version` is the static store version whose dense part projected them (standardise, PCA, L2-normalise).
    """

    version: int
    first: int
    vectors: np.ndarray[Any, Any]  # [n, dims], stored as float16


def fitting(dense: DenseRows | None, n_tokens: int) -> DenseRows | None:
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
    values = tuple(figure(name, stats.get(name, 0)) for name in STATS)
    return values, {part: n for part, value in sorted(parts.items()) if (n := figure(PART_PREFIX + part, value))}


def figure(name: str, value: object) -> int:
    """Return a figure as an int; raise ValueError unless it is an integer in 0..2**31-1."""
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = -1
    if not 0 <= number <= 0x7FFFFFFF:
        raise ValueError(f"learned figures must be integers in 0..2**31-1, got {name}={value!r}")
    return number


def insert_statement(batch: Sequence[Item], store: str, source: str) -> tuple[str, tuple[Any, ...]]:
    """Return the INSERT that appends a batch's rows (the narrowest schema that takes them) and its parameters."""
    columns: list[list[Any]] = [[item.tokens for item in batch], [item.n_tokens for item in batch]]
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
    return query, (store, source, *columns)


class CommitUnknown(Exception):
    """The connection died after the COMMIT of transaction `xid` was sent: it may have committed."""

    def __init__(self, xid: str) -> None:
        super().__init__(xid)
        self.xid = xid


def insert_batch(conn: psycopg.Connection[Any], batch: Sequence[Item], store: str, source: str) -> None:
    """Append a batch in one transaction whose id is read before its COMMIT is sent; raise CommitUnknown, or as psycopg.

    `conn` is in autocommit mode. A failure before the COMMIT leaves nothing written (the transaction is rolled back,
    or ends with its session; the connection is closed when it cannot be rolled back); a COMMIT the server answered
    with an error wrote nothing either; a COMMIT without an answer raises CommitUnknown with the transaction's id.
    """
    query, params = insert_statement(batch, store, source)
    try:
        conn.execute("BEGIN")
        row = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
        xid = str(row[0]) if row is not None else ""
        conn.execute(query, params)
        conn.execute("SELECT pg_notify(%s, %s)", (LEARNED_CHANNEL, store))  # sent to listeners at the COMMIT
    except Exception:
        if not (conn.broken or conn.closed):
            try:
                conn.execute("ROLLBACK")
            except psycopg.Error:
                conn.close()
        raise
    try:
        conn.execute("COMMIT")
    except psycopg.Error as exc:
        if conn.broken or conn.closed:  # no answer: it may have committed
            raise CommitUnknown(xid) from exc
        raise  # the server answered: it rolled back


def transaction_status(conn: psycopg.Connection[Any], xid: str) -> str:
    """Return what became of transaction `xid` on the server: committed, aborted, in progress, or unknown (too old).

    An id in the server's future never reached its history (a failover's promoted replica never saw it): aborted.
    A lost connection or a timeout raises, as psycopg does.
    """
    try:
        row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
    except psycopg.errors.InvalidParameterValue:  # "transaction ID ... is in the future"
        return "aborted"
    except (psycopg.OperationalError, psycopg.InterfaceError):
        raise
    except psycopg.Error as exc:
        log.debug("the status of transaction %s: %s", xid, exc)
        return "unknown"
    return str(row[0]) if row is not None and row[0] is not None else "unknown"
