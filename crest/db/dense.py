"""What crest says to PostgreSQL about a store version's dense part: pgvector rows, their HNSW index, the projection.

A dense part is a stand-alone table `crest_dense_s<ID>` of (embedding vector(D), continuation int4[]) rows
filled by the build of version ID with COPY and indexed with HNSW for inner product (the embeddings are unit
length, so inner product is cosine), plus one `crest_dense` row with what turns a hidden state into a query
(`DenseMeta`: mean, scale, PCA components) and the model it was built with. The table belongs to the version:
the version's publication makes it visible (readers resolve the published version first) and its clean-up
drops it (`crest.db.versions` drops `crest_dense_s<ID>` with the version's other tables). A batch of queries is
one statement: a LATERAL nearest-neighbour scan per query vector. Table names are built from integer ids only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from crest.errors import DatabaseError

EF_SEARCH = 100  # HNSW candidate list of a query (pgvector's default 40 finds ~85% of the true 10 nearest)
HNSW_M, HNSW_EF_CONSTRUCTION = 16, 64  # pgvector's defaults


def dense_table(store_id: int) -> sql.Identifier:
    """Return the identifier of a store version's dense table."""
    return sql.Identifier(f"crest_dense_s{int(store_id)}")


@dataclass(frozen=True)
class DenseMeta:
    """A dense part's projection (hidden state -> unit query vector) and the model it was built with."""

    store_id: int
    model: str
    model_fingerprint: str
    continuation: int
    mean: np.ndarray  # [H] float32
    scale: np.ndarray  # [H] float32, 1 / standard deviation
    components: np.ndarray  # [H, D] float32, PCA directions of the standardised states
    figures: dict[str, Any]

    @property
    def dims(self) -> int:
        return int(self.components.shape[1])

    @property
    def hidden_size(self) -> int:
        return int(self.components.shape[0])

    def project(self, hidden: np.ndarray) -> np.ndarray:
        """Return the unit query vectors [B, D] of hidden states [B, H]: standardise, PCA, L2-normalise."""
        return project(hidden, mean=self.mean, scale=self.scale, components=self.components)


def project(hidden: np.ndarray, *, mean: np.ndarray, scale: np.ndarray, components: np.ndarray) -> np.ndarray:
    """Return (hidden - mean) * scale @ components, each row L2-normalised ([B, H] -> [B, D] float32)."""
    z = (np.asarray(hidden, dtype=np.float32) - mean) * scale @ components  # [B, D]
    norm = np.linalg.norm(z, axis=1, keepdims=True)
    return (z / np.maximum(norm, 1e-12)).astype(np.float32)


def ensure_vector(conn: psycopg.Connection[Any]) -> None:
    """Create the pgvector extension when it is missing; DatabaseError naming the fix when the server lacks it."""
    try:
        with conn.transaction():
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except psycopg.Error as exc:
        raise DatabaseError(
            "a dense part needs the pgvector extension, which this PostgreSQL cannot create "
            f"({str(exc).strip().splitlines()[0]}): install pgvector on the server, or run "
            "`CREATE EXTENSION vector` as a superuser once"
        ) from None


def create_table(conn: psycopg.Connection[Any], store_id: int, *, dims: int) -> None:
    """Create the version's stand-alone dense table (no index yet: it is built after the rows are in)."""
    with conn.transaction():
        conn.execute(
            sql.SQL("CREATE TABLE {} (embedding vector({}) NOT NULL, continuation int4[] NOT NULL)").format(
                dense_table(store_id), sql.Literal(int(dims))
            )
        )


def copy_rows(conn: psycopg.Connection[Any], store_id: int, rows: Iterable[tuple[np.ndarray, list[int]]]) -> int:
    """COPY (unit embedding [D], continuation token ids) rows into the version's dense table; return how many."""
    written = 0
    query = sql.SQL("COPY {} (embedding, continuation) FROM STDIN").format(dense_table(store_id))
    with conn.transaction(), conn.cursor() as cur, cur.copy(query) as copy:
        for vector, tokens in rows:
            copy.write_row((vector_text(vector), "{" + ",".join(map(str, tokens)) + "}"))
            written += 1
    return written


def finish_table(conn: psycopg.Connection[Any], store_id: int) -> None:
    """Build the HNSW index (inner product) of the version's dense table."""
    table = dense_table(store_id)
    with conn.transaction():
        conn.execute("SET LOCAL maintenance_work_mem = '256MB'")
        conn.execute(
            sql.SQL(
                "CREATE INDEX {} ON {} USING hnsw (embedding vector_ip_ops) WITH (m = {}, ef_construction = {})"
            ).format(
                sql.Identifier(f"crest_dense_s{int(store_id)}_hnsw"),
                table,
                sql.Literal(HNSW_M),
                sql.Literal(HNSW_EF_CONSTRUCTION),
            )
        )
    conn.execute(sql.SQL("ANALYZE {}").format(table))
    conn.commit()


def write_meta(conn: psycopg.Connection[Any], meta: DenseMeta) -> None:
    """Record the dense part's projection, model and figures with its version."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO crest_dense (store_id, model, model_fingerprint, hidden_size, dims, continuation, mean,"
            " scale, components, figures) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                meta.store_id,
                meta.model,
                meta.model_fingerprint,
                meta.hidden_size,
                meta.dims,
                meta.continuation,
                np.ascontiguousarray(meta.mean, dtype="<f4").tobytes(),
                np.ascontiguousarray(meta.scale, dtype="<f4").tobytes(),
                np.ascontiguousarray(meta.components, dtype="<f4").tobytes(),
                json.dumps(meta.figures),
            ),
        )


def read_meta(conn: psycopg.Connection[Any], store_id: int) -> DenseMeta | None:
    """Return the dense part of store version `store_id`, or None when it has none."""
    row = conn.execute(
        "SELECT model, model_fingerprint, hidden_size, dims, continuation, mean, scale, components, figures"
        " FROM crest_dense WHERE store_id = %s",
        (store_id,),
    ).fetchone()
    if row is None:
        return None
    model, fingerprint, hidden, dims, continuation, mean, scale, components, figures = row
    return DenseMeta(
        store_id=int(store_id),
        model=str(model),
        model_fingerprint=str(fingerprint),
        continuation=int(continuation),
        mean=np.frombuffer(mean, dtype="<f4").astype(np.float32),
        scale=np.frombuffer(scale, dtype="<f4").astype(np.float32),
        components=np.frombuffer(components, dtype="<f4").astype(np.float32).reshape(int(hidden), int(dims)),
        figures=dict(figures or {}),
    )


def table_bytes(conn: psycopg.Connection[Any], store_id: int) -> dict[str, int]:
    """Return the on-disk bytes of the version's dense table (with TOAST) and of its index."""
    name = f"crest_dense_s{int(store_id)}"
    row = conn.execute(
        "SELECT coalesce(pg_table_size(to_regclass(%s)), 0), coalesce(pg_indexes_size(to_regclass(%s)), 0)",
        (name, name),
    ).fetchone()
    assert row is not None
    return {"table_bytes": int(row[0]), "index_bytes": int(row[1])}


def tune(conn: psycopg.Connection[Any], *, ef_search: int = EF_SEARCH) -> None:
    """Set the session's HNSW candidate list for later searches (once per connection: a search is one statement)."""
    conn.execute(sql.SQL("SET hnsw.ef_search = {}").format(sql.Literal(int(ef_search))))


def search(
    conn: psycopg.Connection[Any], store_id: int, queries: np.ndarray, *, k: int, exact: bool = False
) -> list[list[tuple[list[int], float]]]:
    """Return, per unit query vector [B, D], its `k` nearest rows as (continuation, cosine similarity), best first.

    One statement for the whole batch, with the session's `hnsw.ef_search` (`tune`); `exact` scans without the
    index (the recall reference).
    """
    if len(queries) == 0:
        return []
    order = "(embedding <#> q.v) + 0" if exact else "embedding <#> q.v"  # an expression the index cannot serve
    query = sql.SQL(
        "SELECT q.i, d.continuation, d.sim FROM unnest(%s::vector[]) WITH ORDINALITY AS q(v, i)"
        " CROSS JOIN LATERAL (SELECT continuation, -(embedding <#> q.v) AS sim FROM {}"
        " ORDER BY " + order + " LIMIT %s) AS d ORDER BY q.i, d.sim DESC"
    ).format(dense_table(store_id))
    rows = conn.execute(query, ([vector_text(q) for q in queries], int(k))).fetchall()
    found: list[list[tuple[list[int], float]]] = [[] for _ in range(len(queries))]
    for i, tokens, sim in rows:
        found[int(i) - 1].append((list(tokens), float(sim)))
    return found


def vector_text(vector: np.ndarray) -> str:
    """Return pgvector's text form of a vector: [x1,x2,...]."""
    return "[" + ",".join(f"{x:.7g}" for x in np.asarray(vector, dtype=np.float32).tolist()) + "]"
