"""The live tier's dense part: the states a server computed for the tokens it served, with the tokens that followed.

A server that serves a store with a dense part records, with each finished request's learned row, the hidden
state behind each of its tokens, projected by the static version's dense part (`crest_learned.dense`, written by
the `crest_client.learner.Learner`; `crest.serving.scheduler` keeps them from the verify forwards it runs anyway).
A refresh turns the last `window` of those states into dense entries: each state at row position p with the
row's tokens p + 1 .. p + L after it (L the static dense part's continuation; the first is the token the state
predicted, as in the static part), in the live version's own `crest_dense_s<ID>` table under an HNSW index, with
a `crest_dense` row that copies the static part's projection and names the static version. It is built inside the
live version's build (`build_store(before_publish=...)`), so it is published with the live version in one
transaction and dropped with it when a later refresh retires it; a killed refresh leaves the previous live version
and its dense part whole. Only states projected by the published static version's dense part are read (a new
static version starts the live dense part afresh); the part is rebuilt from its window on every refresh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import psycopg

from crest import db
from crest.config import fault_pause
from crest.db import dense as dense_db

_FETCH_ROWS = 500


@dataclass
class DenseWindow:
    """The last recorded dense entries of a store: unit vectors [N, D] with their continuations, oldest first."""

    vectors: np.ndarray  # [N, D] float32
    continuations: list[list[int]]  # N token lists, each of at least 2 ids
    from_id: int  # learned row id of the oldest entry
    rows: int  # learned rows the entries come from

    def __len__(self) -> int:
        return len(self.continuations)


def read_dense(
    conn: psycopg.Connection[Any], store: str, *, meta: dense_db.DenseMeta, through_id: int, window: int
) -> DenseWindow:
    """Return the store's last `window` dense entries recorded with `meta`'s projection, up to row `through_id`."""
    parts: list[tuple[int, np.ndarray, list[list[int]]]] = []  # newest row first
    total = 0
    length = meta.continuation
    with conn.transaction(), conn.cursor(name="crest_learned_dense") as cur:
        cur.itersize = _FETCH_ROWS
        cur.execute(
            "SELECT id, tokens, dense_first, dense FROM crest_learned WHERE store = %s AND id <= %s"
            " AND dense_version = %s AND dense IS NOT NULL ORDER BY id DESC",
            (store, through_id, meta.store_id),
        )
        for sid, data, first, blob in cur:
            if total >= window:
                break
            tokens = np.frombuffer(bytes(data), dtype="<u4").astype(np.int64)
            vectors = np.frombuffer(bytes(blob), dtype="<f2")
            if vectors.shape[0] % meta.dims:
                continue  # not this projection's width: never written by a server of this version
            vectors = vectors.reshape(-1, meta.dims)
            at = int(first) + np.arange(vectors.shape[0])  # [n] row position of each state
            keep = np.flatnonzero(at + 3 <= tokens.shape[0])  # at least 2 tokens after the state's position
            keep = keep[max(0, keep.shape[0] - (window - total)) :]  # the row's newest entries fill the window
            if keep.shape[0] == 0:
                continue
            conts = [tokens[p + 1 : p + 1 + length].tolist() for p in at[keep].tolist()]
            parts.append((int(sid), vectors[keep], conts))
            total += keep.shape[0]
    parts.reverse()
    if not parts:
        return DenseWindow(np.zeros((0, meta.dims), dtype=np.float32), [], 0, 0)
    vectors = np.concatenate([v for _, v, _ in parts]).astype(np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # unit again after float16
    return DenseWindow(vectors, [c for _, _, cs in parts for c in cs], parts[0][0], len(parts))


class LiveDense:
    """Builds a live version's dense part from a window of entries (`build`: `build_store`'s `before_publish`)."""

    def __init__(self, meta: dense_db.DenseMeta, entries: DenseWindow, *, window: int) -> None:
        self.meta, self.entries, self.window = meta, entries, window
        self.rows = 0

    def build(self, build: db.Build) -> None:
        """Load, index and describe the entries as the dense part of the version being built (before publishing)."""
        if not len(self.entries):
            return
        started = time.perf_counter()
        conn = build.conn
        static = self.meta.index  # the static part's index kind and column type, sized for these rows
        dense_db.create_table(conn, build.store_id, dims=self.meta.dims, vector=static.vector)
        self.rows = dense_db.copy_rows(
            conn, build.store_id, zip(self.entries.vectors, self.entries.continuations, strict=True)
        )
        fault_pause("live-dense")  # test hook: the live entries are in, not indexed nor published
        index = dense_db.AnnIndex.for_rows(static.kind, self.rows, vector=static.vector)
        dense_db.finish_table(conn, build.store_id, index=index)
        figures = {
            **dense_db.table_bytes(conn, build.store_id),
            "index": index.record(),
            "rows": self.rows,
            "learned_rows": self.entries.rows,
            "from_id": self.entries.from_id,
            "window": self.window,
            "static_version": self.meta.store_id,
            "seconds": round(time.perf_counter() - started, 3),
        }
        dense_db.write_meta(conn, replace(self.meta, store_id=build.store_id, figures=figures))


def live_dense(
    conn: psycopg.Connection[Any], store: str, *, static_id: int, through_id: int, window: int
) -> LiveDense | None:
    """Return the builder of the live dense part of `store`, or None: its static version has no dense part."""
    if window <= 0:
        return None
    try:
        meta = dense_db.read_meta(conn, static_id)
    except psycopg.errors.UndefinedTable:
        conn.rollback()
        return None
    if meta is None:
        return None
    return LiveDense(meta, read_dense(conn, store, meta=meta, through_id=through_id, window=window), window=window)
