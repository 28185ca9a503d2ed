"""The lookup statements and the keys they probe.

A single context is looked up with `probe_sql`: a UNION ALL of single-key probes of one version's partition,
longest first, under LIMIT 1, so the server stops at the first hit (each probe an O(1) hash-index scan). Many
contexts (a server's batch) are looked up with `batch_sql`: one statement whose two array parameters list
(context index, key) pairs for every candidate suffix of every context; a nested loop of hash-index probes
joins them to the partition and DISTINCT ON keeps each context's longest hit. With a live tier the statement
holds a second such part over the live version's partition, so one round trip returns both candidates.
`batch_keys` builds the pairs for a batch with a few numpy operations: each context's suffix hashes, the
version's key filter, and the big-endian keys of the suffixes it may hold.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg import pq

from crest_client.keyfilter import suffix_hashes_many


def probe_sql(store_id: int, probes: int, *, every: bool = False) -> str:
    """Return the one-round-trip lookup of `probes` keys of a store version, longest first.

    Rows (n, tree): the first hit only, the server stopping there; with `every`, rows (n, count, tree) of every
    stored key, for a rule that weighs them.
    """
    columns = "n, count, tree" if every else "n, tree"
    probe = f"(SELECT {columns} FROM crest_ngrams_s{int(store_id)} WHERE key = %s)"
    return " UNION ALL ".join([probe] * probes) + ("" if every else " LIMIT 1")


def batch_sql(version_ids: Sequence[int], *, every: bool = False) -> str:
    """Return the lookup of many contexts in the given versions (static, then live).

    Rows (i, part, n, count, tree): each context's longest stored key per version, or with `every` all of them.
    """
    parts = []
    for part, sid in enumerate(version_ids):
        pick = "" if every else "DISTINCT ON (q.i) "
        order = "" if every else " ORDER BY q.i, t.n DESC"
        parts.append(
            f"(SELECT {pick}q.i, {part} AS part, t.n, t.count, t.tree"
            f" FROM unnest(%s::int4[], %s::bytea[]) AS q(i, key) JOIN crest_ngrams_s{int(sid)} AS t ON t.key = q.key"
            f"{order})"
        )
    return " UNION ALL ".join(parts)


def batch_keys(tails: Sequence[Sequence[int]], info: Any) -> tuple[list[int], list[bytes]]:
    """Return (context index, key) pairs of every suffix of each tail that the version may hold."""
    max_n, width, vocab = info.max_n, info.token_width, info.vocab_size
    lengths = np.fromiter((min(len(t), max_n) for t in tails), dtype=np.int64, count=len(tails))  # [B]
    grid = np.zeros((len(tails), max_n), dtype=np.int64)  # [B, max_n] right-aligned tails
    for r, tail in enumerate(tails):
        if lengths[r]:
            grid[r, max_n - lengths[r] :] = tail[-int(lengths[r]) :]
    ks = np.arange(1, max_n + 1)
    usable = ks[None, :] <= lengths[:, None]  # [B, max_n] column k - 1: the last k tokens exist
    outside = ((grid < 0) | (grid >= vocab)) & (np.arange(max_n)[None, :] >= max_n - lengths[:, None])
    usable &= ~outside.any(axis=1, keepdims=True)  # a token outside the vocabulary: no lookup
    found = info.key_filter
    if found is not None:
        usable &= found.contains_many(suffix_hashes_many(grid))
    raw = grid.astype(f">u{width}").tobytes()
    row_bytes = max_n * width
    index: list[int] = []
    keys: list[bytes] = []
    for r, k in zip(*np.nonzero(usable[:, ::-1]), strict=True):  # longest first within a context
        end = (int(r) + 1) * row_bytes
        index.append(int(r))
        keys.append(raw[end - (max_n - int(k)) * width : end])
    return index, keys


INT4_ARRAY, BYTEA_ARRAY = 1007, 1001  # type oids of the batch statement's parameters
_INT4, _BYTEA = 23, 17
_ARRAY_HEAD = struct.Struct("!iiiii")  # ndim, has nulls, element oid, length, lower bound
_LENGTH = struct.Struct("!i")


def int4_array(values: Sequence[int]) -> bytes:
    """Return PostgreSQL's binary form of an int4[] holding `values`."""
    if not values:
        return struct.pack("!iii", 0, 0, _INT4)
    body = np.empty((len(values), 2), dtype=">i4")  # [K, 2] each element's length (4) and value
    body[:, 0], body[:, 1] = 4, values
    return _ARRAY_HEAD.pack(1, 0, _INT4, len(values), 1) + body.tobytes()


def bytea_array(values: Sequence[bytes]) -> bytes:
    """Return PostgreSQL's binary form of a bytea[] holding `values`."""
    if not values:
        return struct.pack("!iii", 0, 0, _BYTEA)
    pack = _LENGTH.pack
    return _ARRAY_HEAD.pack(1, 0, _BYTEA, len(values), 1) + b"".join([pack(len(v)) + v for v in values])


def numbered(query: str) -> str:
    """Return `query` with psycopg's %s placeholders numbered for libpq ($1, $2, ...)."""
    parts = query.split("%s")
    return "".join(part + (f"${i}" if i < len(parts) else "") for i, part in enumerate(parts, 1))


def check_result(res: Any) -> Any:
    """Return a libpq result, or raise the psycopg error its SQLSTATE names."""
    if res.status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        return res
    state = res.error_field(pq.DiagnosticField.SQLSTATE)
    message = (res.error_message or b"").decode(errors="replace").strip() or "lookup failed"
    if state is None:
        raise psycopg.OperationalError(message)
    raise psycopg.errors.lookup(state.decode())(message)
