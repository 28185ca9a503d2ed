"""What crest says to PostgreSQL about a store version's dense part: pgvector rows, their ANN index, the projection.

A dense part is a stand-alone table `crest_dense_s<ID>` of (embedding halfvec(D) or vector(D), continuation int4[])
rows filled by the build of version ID with COPY and indexed for inner product (the embeddings are unit length, so
inner product is cosine) with the ANN index its `AnnIndex` names (IVFFlat by default, HNSW selectable), plus one
`crest_dense` row with what turns a hidden state into a query (`DenseMeta`: mean, scale, PCA components), the
model it was built with and its figures, which record the index, its search setting and the column type (the
precision: halfvec, float16, by default; a part recorded without one is float32 `vector`). The table belongs to the
version: the version's publication makes it visible (readers resolve the published version first) and its
clean-up drops it (`crest.db.versions` drops `crest_dense_s<ID>` with the version's other tables). A batch of
queries is one statement: a LATERAL nearest-neighbour scan per query vector, the queries sent as one binary
pgvector parameter (`PackedVectors`) and the rows read in binary. Table names are built from integer ids only.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import psycopg
from psycopg import sql
from psycopg.adapt import Dumper
from psycopg.pq import Format

from crest.errors import DatabaseError

INDEX_KINDS = ("ivfflat", "hnsw")  # `crest ingest --dense-index`; the first is the default
VECTOR_TYPES = ("vector", "halfvec")  # pgvector's float32 and float16 column types
PRECISIONS = {"half": "halfvec", "single": "vector"}  # `crest ingest --dense-precision` -> the column type
EF_SEARCH = 100  # HNSW candidate list of a query (pgvector's default 40 finds ~85% of the true 10 nearest)
HNSW_M, HNSW_EF_CONSTRUCTION = 16, 64  # pgvector's defaults
# IVFFlat (docs/benchmarks.md, "The 5 ms batch"): a query's cost is pgvector's full sort of every row of the lists
# it probes, so fine lists (fewer rows for the same recall) are cheaper; k-means memory bounds how fine.
ROWS_PER_LIST = 50  # about this many rows a list...
MAX_LISTS = 2000  # ... at most this many: pgvector's k-means needs 4 x 50 lists x lists bytes (800 MB here)
PROBE_SHARE = 0.01  # share of the lists a query scans (recall@16 0.93 at 100k rows, 1,000 rows scanned)...
SCAN_MIN = 1000  # ... and at least about this many rows (a small table is searched nearly exactly)
BUILD_MEMORY_MB = 256  # maintenance_work_mem of an index build, or what IVFFlat's k-means needs when more
QUERY_COMPONENTS = 16000  # pgvector's most dimensions of a vector: a statement's queries travel as one


@dataclass(frozen=True)
class AnnIndex:
    """How a dense table is indexed and searched: index kind, build parameters and the search setting.

    HNSW walks a graph per query (`m`, `ef_construction`; `ef_search` candidates); IVFFlat scans the `probes`
    lists whose centroids are nearest to the query out of `lists`. `vector` is the column's type (halfvec:
    float16, half the bytes). Parts built before the choice existed are float32 HNSW with pgvector's defaults,
    which is what an `AnnIndex()` of an empty record says.
    """

    kind: str = "hnsw"
    vector: str = "vector"
    m: int = HNSW_M
    ef_construction: int = HNSW_EF_CONSTRUCTION
    ef_search: int = EF_SEARCH
    lists: int = 1
    probes: int = 1

    @classmethod
    def for_rows(cls, kind: str, rows: int, *, vector: str = "vector") -> AnnIndex:
        """Return the index of `kind` for `rows` rows (IVFFlat: ~ROWS_PER_LIST rows a list, PROBE_SHARE probed)."""
        if kind not in INDEX_KINDS or vector not in VECTOR_TYPES:
            raise ValueError(f"unknown dense index {kind!r} over {vector!r}")
        if kind == "hnsw":
            return cls(kind="hnsw", vector=vector)
        lists = max(1, min(rows // ROWS_PER_LIST, MAX_LISTS))
        probes = min(lists, max(math.ceil(PROBE_SHARE * lists), math.ceil(SCAN_MIN * lists / max(rows, 1))))
        return cls(kind="ivfflat", vector=vector, lists=lists, probes=probes)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> AnnIndex:
        """Return the index a dense part's figures record (HNSW with the defaults when they record none)."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in (record or {}).items() if key in known})

    def record(self) -> dict[str, Any]:
        """Return the parameters that matter for this kind, for the dense part's figures."""
        keep = ("m", "ef_construction", "ef_search") if self.kind == "hnsw" else ("lists", "probes")
        return {key: value for key, value in asdict(self).items() if key in ("kind", "vector", *keep)}

    def create(self, table: sql.Identifier, name: str) -> sql.Composed:
        """Return the CREATE INDEX statement of this index on `table` (inner product)."""
        if self.kind == "hnsw":
            params = sql.SQL("m = {}, ef_construction = {}").format(
                sql.Literal(int(self.m)), sql.Literal(int(self.ef_construction))
            )
        else:
            params = sql.SQL("lists = {}").format(sql.Literal(int(self.lists)))
        return sql.SQL("CREATE INDEX {} ON {} USING {} (embedding {}) WITH ({})").format(
            sql.Identifier(name), table, sql.SQL(self.kind), sql.SQL(f"{self.vector}_ip_ops"), params
        )

    def build_memory_mb(self) -> int:
        """Return the maintenance_work_mem (MB) that building this index needs (IVFFlat: k-means on its samples)."""
        if self.kind == "hnsw":
            return BUILD_MEMORY_MB  # a graph that outgrows it builds slower, never fails
        samples = max(50 * self.lists, 10_000)  # pgvector samples 50 rows a list: a [samples, lists] float32 bound
        return max(BUILD_MEMORY_MB, math.ceil(4 * samples * self.lists / 2**20) + 64)

    def setting(self) -> sql.Composed:
        """Return the SET statement of this index's search setting (a session's, once per connection)."""
        if self.kind == "hnsw":
            return sql.SQL("SET hnsw.ef_search = {}").format(sql.Literal(int(self.ef_search)))
        return sql.SQL("SET ivfflat.probes = {}").format(sql.Literal(int(self.probes)))


def vector_type(precision: str) -> str:
    """Return the column type of a dense part's `precision` (half or single); ValueError for another name."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown dense precision {precision!r}")
    return PRECISIONS[precision]


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
    def index(self) -> AnnIndex:
        """Return the ANN index the part was built with, as its figures record it."""
        return AnnIndex.from_record(self.figures.get("index"))

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


def create_table(conn: psycopg.Connection[Any], store_id: int, *, dims: int, vector: str = "vector") -> None:
    """Create the version's stand-alone dense table (no index yet: it is built after the rows are in)."""
    if vector not in VECTOR_TYPES:
        raise ValueError(f"unknown vector type {vector!r}")
    with conn.transaction():
        conn.execute(
            sql.SQL("CREATE TABLE {} (embedding {}({}) NOT NULL, continuation int4[] NOT NULL)").format(
                dense_table(store_id), sql.SQL(vector), sql.Literal(int(dims))
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


def finish_table(conn: psycopg.Connection[Any], store_id: int, *, index: AnnIndex | None = None) -> None:
    """Build the ANN index (inner product; HNSW with the defaults when none is given) of the version's dense table."""
    build_index(conn, dense_table(store_id), f"crest_dense_s{int(store_id)}_{(index or AnnIndex()).kind}", index)


def build_index(conn: psycopg.Connection[Any], table: sql.Identifier, name: str, index: AnnIndex | None) -> None:
    """Build `index` named `name` on a dense table, then analyze the table."""
    with conn.transaction():
        index = index or AnnIndex()
        conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(f"{index.build_memory_mb()}MB"))
        conn.execute(index.create(table, name))
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


def tune(conn: psycopg.Connection[Any], index: AnnIndex | None = None) -> None:
    """Set the session's search setting of `index` (HNSW's defaults when none) for later searches."""
    conn.execute((index or AnnIndex()).setting())


def search(
    conn: psycopg.Connection[Any],
    store_id: int,
    queries: np.ndarray,
    *,
    k: int,
    exact: bool = False,
    vector: str = "vector",
) -> list[list[tuple[list[int], float]]]:
    """Return, per unit query vector [B, D], its `k` nearest rows as (continuation, cosine similarity), best first.

    One statement for the whole batch, with the session's search setting (`tune`); `exact` scans without the
    index (the recall reference); `vector` is the column's type.
    """
    found = search_table(conn, dense_table(store_id), queries, k=k, exact=exact, vector=vector)
    return [[(list(tokens), sim) for tokens, sim in row] for row in found]


def search_table(
    conn: psycopg.Connection[Any],
    table: sql.Identifier,
    queries: np.ndarray,
    *,
    k: int,
    exact: bool = False,
    vector: str = "vector",
    payload: str = "continuation",
) -> list[list[tuple[Any, float]]]:
    """Return, per unit query vector [B, D], the `payload` column and similarity of its `k` nearest rows in `table`."""
    order = "(embedding <#> x.v) + 0" if exact else "embedding <#> x.v"  # an expression the index cannot serve
    scan = sql.SQL("SELECT {} AS payload, -(embedding <#> x.v) AS sim FROM {} ORDER BY " + order + " LIMIT %(k)s")
    return _batched(conn, scan.format(sql.Identifier(payload), table), queries, k=k, vector=vector)


def _batched(
    conn: psycopg.Connection[Any], scan: sql.Composed, queries: np.ndarray, *, k: int, vector: str
) -> list[list[tuple[Any, float]]]:
    """Run `scan` (payload, sim of query x.v, best first) once per query, one statement per QUERY_COMPONENTS."""
    queries = np.asarray(queries, dtype=np.float32)
    found: list[list[tuple[Any, float]]] = [[] for _ in range(len(queries))]
    if len(queries) == 0:
        return found
    dims = int(queries.shape[1])
    per = max(1, QUERY_COMPONENTS // dims)  # queries a statement: one vector of at most QUERY_COMPONENTS
    query = sql.SQL(
        "SELECT q.i, d.payload, d.sim FROM generate_series(1, %(n)s) AS q(i)"
        " CROSS JOIN LATERAL (SELECT subvector(%(q)b::{}, (q.i - 1) * {} + 1, {}) AS v) AS x"
        " CROSS JOIN LATERAL ({}) AS d ORDER BY q.i, d.sim DESC"
    ).format(sql.SQL(_column_type(vector)), sql.Literal(dims), sql.Literal(dims), scan)
    with conn.cursor(binary=True) as cur:  # binary rows: int4[] continuations without parsing text
        for lo in range(0, len(queries), per):
            part = queries[lo : lo + per]
            params = {"n": len(part), "q": PackedVectors(part, vector=vector), "k": int(k)}
            for i, value, sim in cur.execute(query, params).fetchall():
                found[lo + int(i) - 1].append((value, float(sim)))
    return found


def _column_type(vector: str) -> str:
    return "halfvec" if vector == "halfvec" else "vector"


class PackedVectors:
    """Query vectors [B, D] as ONE pgvector vector of B x D components in its binary form (a statement slices it).

    Binary, not text: formatting 16 x 64 floats as text costs the client about 0.3 ms a batch, and the server
    parsing them; a halfvec query is rounded to float16 here, as the server's cast would.
    """

    __slots__ = ("data",)

    def __init__(self, queries: np.ndarray, *, vector: str = "vector") -> None:
        flat = np.asarray(queries, dtype=np.float32).reshape(-1)
        body = flat.astype(">f2" if vector == "halfvec" else ">f4").tobytes()  # big-endian components
        self.data = struct.pack(">HH", flat.size, 0) + body  # dims, unused: pgvector's vector_recv/halfvec_recv


class _PackedDumper(Dumper):
    format = Format.BINARY
    oid = 0  # unknown: the server reads the parameter as the type of the cast around it (%b::halfvec)

    def dump(self, obj: PackedVectors) -> bytes:
        return obj.data


psycopg.adapters.register_dumper(PackedVectors, _PackedDumper)  # connections opened later dump it


def vector_text(vector: np.ndarray) -> str:
    """Return pgvector's text form of a vector: [x1,x2,...]."""
    return "[" + ",".join(f"{x:.7g}" for x in np.asarray(vector, dtype=np.float32).tolist()) + "]"


def search_with_live(
    conn: psycopg.Connection[Any],
    store_id: int,
    live_id: int,
    queries: np.ndarray,
    *,
    k: int,
    vector: str = "vector",
) -> list[list[tuple[list[int], float]]]:
    """Return, per unit query vector [B, D], its `k` nearest rows of a static dense table and its live one together.

    One statement for the whole batch: each table's own index scan (k rows each), then the best `k` of both by
    similarity (the live part is projected like the static one: `crest.learning.live_dense`).
    """
    scan = "(SELECT continuation, -(embedding <#> x.v) AS sim FROM {} ORDER BY embedding <#> x.v LIMIT %(k)s)"
    both = sql.SQL(
        "SELECT continuation AS payload, sim FROM ("
        + scan
        + " UNION ALL "
        + scan
        + ") AS u ORDER BY sim DESC LIMIT %(k)s"
    ).format(dense_table(store_id), dense_table(live_id))
    found = _batched(conn, both, queries, k=k, vector=vector)
    return [[(list(tokens), sim) for tokens, sim in row] for row in found]
