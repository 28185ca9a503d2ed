"""The dense lookup measured side by side: a batch's latency and recall@k of each ANN index on one dense part.

`compare_indexes` copies a published store's dense part into scratch tables, one per candidate (`parse_variant`: the
index kind, the vector type, build and search parameters, e.g. `ivfflat:lists=100:probes=8` or `hnsw+halfvec`),
builds each candidate's index and sends the same batches of query vectors to every candidate in turn, round after
round, so that a loaded machine weighs on all of them alike; the load average is read before and after. Each
candidate searches through its own connection, tuned once, with the statement the drafters send
(`crest.db.dense.search_table`, one per batch, continuations fetched). Beside each batch's wall time, its CPU time:
the server backend's (from /proc, when the database runs on this machine) plus this process's, which a loaded
machine does not inflate (a quiet core's wall time is about that). Recall@k is against exact search on the stored
float32 vectors (numpy). The queries are the target's own hidden states (`hidden_queries`: one forward over prompts,
projected as a drafter's are) or stored vectors plus noise (`noisy_queries`). The scratch tables are dropped at the
end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from crest.db import dense as dense_db
from crest.errors import ConfigError

VARIANTS = ("ivfflat", "hnsw")  # the product's choices, with their recorded defaults
_SCRATCH = "crest_dense_bench_{}"


@dataclass(frozen=True)
class Variant:
    """One candidate: a label and the index it builds and searches with."""

    label: str
    index: dense_db.AnnIndex


def parse_variant(text: str, *, rows: int) -> Variant:
    """Parse `KIND[+halfvec][:key=value]...` (keys: AnnIndex's fields) into a candidate for `rows` rows."""
    head, _, tail = text.partition(":")
    kind, _, vector = head.partition("+")
    try:
        index = dense_db.AnnIndex.for_rows(kind, rows, vector=vector or "vector")
        pairs = [item.split("=", 1) for item in tail.split(":") if item]
        settings: dict[str, Any] = {key.strip(): int(value) for key, value in pairs}
        index = replace(index, **settings)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"bad dense index variant {text!r} (KIND[+halfvec][:key=value]...): {exc}") from None
    return Variant(text, index)


def hidden_queries(model_spec: str, meta: dense_db.DenseMeta, *, prompts: str, limit: int) -> np.ndarray:
    """Return the unit query vectors [Q, D] of the model's hidden states at every position of the prompts."""
    import torch

    from crest.decoding.hidden import final_hidden
    from crest.decoding.models import load_model
    from crest.ingest.prompts import load_prompts

    loaded = load_model(model_spec)
    states = []
    for text in load_prompts(prompts, limit=limit):
        ids = torch.tensor([loaded.tokenizer(text)["input_ids"]], device=loaded.device)
        states.append(final_hidden(loaded.model, ids)[0].float().cpu().numpy())  # [N, H]
    return meta.project(np.concatenate(states))


def noisy_queries(vectors: np.ndarray, *, count: int, noise: float, seed: int = 0) -> np.ndarray:
    """Return `count` stored unit vectors plus Gaussian noise of `noise` per component, normalised again [Q, D]."""
    rng = np.random.default_rng(seed)
    picked = vectors[rng.integers(0, vectors.shape[0], count)] + noise * rng.normal(size=(count, vectors.shape[1]))
    return (picked / np.linalg.norm(picked, axis=1, keepdims=True)).astype(np.float32)


def stored_vectors(conn: psycopg.Connection[Any], store_id: int) -> np.ndarray:
    """Return the dense part's vectors [N, D] in the table's order (row i is id i + 1 of the scratch copies)."""
    rows = conn.execute(
        sql.SQL("SELECT embedding::real[] FROM {} ORDER BY ctid").format(dense_db.dense_table(store_id))
    ).fetchall()
    return np.array([r[0] for r in rows], dtype=np.float32)


def compare_indexes(
    dsn: str,
    store_id: int,
    variants: Sequence[Variant],
    queries: np.ndarray,
    vectors: np.ndarray,
    *,
    batch: int = 16,
    k: int = 16,
    rounds: int = 200,
) -> dict[str, Any]:
    """Build each candidate's index on a scratch copy; return its batch latency (p50/p95 ms) and recall@k."""
    truth = np.argsort(-(queries @ vectors.T), axis=1)[:, :k] + 1  # [Q, k] ids of the exact nearest
    conns: list[psycopg.Connection[Any]] = []
    built: list[tuple[float, int, int]] = []  # (build seconds, table bytes, index bytes) per candidate
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            dims = int(vectors.shape[1])
            built = [_scratch_copy(admin, store_id, i, v.index, dims=dims) for i, v in enumerate(variants)]
        for variant in variants:
            conn = psycopg.connect(dsn, autocommit=True)
            conns.append(conn)
            dense_db.tune(conn, variant.index)
        recall = [_recall(conns[i], i, v.index, queries, truth, k=k) for i, v in enumerate(variants)]
        load_before = os.getloadavg()
        times, cpu = _time_rounds(conns, variants, queries, batch=batch, k=k, rounds=rounds)
        load_after = os.getloadavg()
    finally:
        for conn in conns:
            conn.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            for i in range(len(variants)):
                admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(_SCRATCH.format(i))))
    return {
        "rows": int(vectors.shape[0]),
        "queries": int(queries.shape[0]),
        "batch": batch,
        "k": k,
        "rounds": rounds,
        "load_average": [round(x, 2) for x in (*load_before, *load_after)],  # 1/5/15 min before, then after
        "variants": {
            v.label: {
                "index": v.index.record(),
                "build_seconds": round(built[i][0], 2),
                "table_bytes": built[i][1],  # (id, embedding, continuation) rows: a dense table and an id
                "index_bytes": built[i][2],
                "p50_ms": round(1000 * float(np.percentile(times[i], 50)), 2),
                "p95_ms": round(1000 * float(np.percentile(times[i], 95)), 2),
                "cpu_ms": _per_batch(cpu[i], rounds),
                "recall": round(recall[i], 4),
            }
            for i, v in enumerate(variants)
        },
    }


def _per_batch(seconds: float | None, rounds: int) -> float | None:
    """Return milliseconds per batch of a total over `rounds` batches (None stays None)."""
    return None if seconds is None else round(1000 * seconds / rounds, 2)


def _scratch_copy(
    conn: psycopg.Connection[Any], store_id: int, i: int, index: dense_db.AnnIndex, *, dims: int
) -> tuple[float, int, int]:
    """Copy the dense part into scratch table i (id, embedding of the index's type, continuation) and index it.

    Return the index's build seconds, the table's bytes and the index's bytes.
    """
    table = sql.Identifier(_SCRATCH.format(i))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} AS SELECT row_number() OVER (ORDER BY ctid)::int AS id,"
            " embedding::{}({}) AS embedding, continuation FROM {}"
        ).format(table, sql.SQL(index.vector), sql.Literal(dims), dense_db.dense_table(store_id))
    )
    t0 = time.perf_counter()
    dense_db.build_index(conn, table, f"{_SCRATCH.format(i)}_idx", index)
    seconds = time.perf_counter() - t0
    name = _SCRATCH.format(i)
    sizes = "SELECT pg_table_size(to_regclass(%s)), pg_indexes_size(to_regclass(%s))"
    row = conn.execute(sizes, (name, name)).fetchone()
    return (seconds, int(row[0]), int(row[1])) if row else (seconds, 0, 0)


def _recall(
    conn: psycopg.Connection[Any], i: int, index: dense_db.AnnIndex, queries: np.ndarray, truth: np.ndarray, *, k: int
) -> float:
    """Return the mean share of each query's exact `k` nearest that the index finds."""
    table = sql.Identifier(_SCRATCH.format(i))
    hits = 0
    for lo in range(0, queries.shape[0], 64):
        found = dense_db.search_table(conn, table, queries[lo : lo + 64], k=k, vector=index.vector, payload="id")
        for row, want in zip(found, truth[lo : lo + 64], strict=True):
            hits += len({int(v) for v, _ in row} & set(want.tolist()))
    return hits / (k * queries.shape[0])


def _time_rounds(
    conns: Sequence[psycopg.Connection[Any]],
    variants: Sequence[Variant],
    queries: np.ndarray,
    *,
    batch: int,
    k: int,
    rounds: int,
) -> tuple[list[list[float]], list[float | None]]:
    """Time one batch per candidate per round, the same batch for all, the order rotated each round.

    Return each candidate's wall seconds per batch and its total CPU seconds (backend and client; None: the
    backend's is unknown).
    """
    rng = np.random.default_rng(1)
    times: list[list[float]] = [[] for _ in variants]
    cpu: list[float | None] = [0.0 for _ in variants]
    for r in range(rounds + 5):  # 5 warm-up rounds (caches, prepared statements) not counted
        picked = queries[rng.integers(0, queries.shape[0], batch)]
        for j in np.roll(np.arange(len(variants)), r).tolist():
            table = sql.Identifier(_SCRATCH.format(j))
            server, client, t0 = _backend_cpu(conns[j]), time.process_time(), time.perf_counter()
            dense_db.search_table(conns[j], table, picked, k=k, vector=variants[j].index.vector)  # the drafter's
            wall, used, after = time.perf_counter() - t0, time.process_time() - client, _backend_cpu(conns[j])
            if r >= 5:
                times[j].append(wall)
                spent = cpu[j]
                cpu[j] = None if spent is None or server is None or after is None else spent + used + after - server
    return times, cpu


def _backend_cpu(conn: psycopg.Connection[Any]) -> float | None:
    """Return the CPU seconds (user + system) the connection's server process has used, None when unreadable."""
    try:
        fields = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None  # the server runs elsewhere
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def lookup_figures(
    store: str,
    *,
    dsn: str | None = None,
    variants: Sequence[str] = VARIANTS,
    queries: str = "hidden",
    model: str = "smollm2",
    prompts: str = "humaneval",
    limit: int = 20,
    batch: int = 16,
    k: int = 16,
    rounds: int = 200,
) -> dict[str, Any]:
    """Return `compare_indexes` on the published store's dense part; queries `hidden` (the model's) or `noisy`."""
    from crest_client.names import resolve_dsn

    from crest.drafters.dense_index import open_dense

    url = resolve_dsn(dsn)
    index = open_dense(store, dsn=url)
    try:
        meta = index.meta
        if meta is None:
            raise ConfigError(f"store {store!r}'s dense part cannot be read now")
        with psycopg.connect(url) as conn:
            vectors = stored_vectors(conn, meta.store_id)
    finally:
        index.close()
    candidates = [parse_variant(v, rows=vectors.shape[0]) for v in variants]  # bad input said before the model runs
    if queries == "hidden":
        asked = hidden_queries(model, meta, prompts=prompts, limit=limit)
    elif queries == "noisy":
        asked = noisy_queries(vectors, count=1000, noise=0.05)
    else:
        raise ConfigError(f"--queries must be hidden or noisy, not {queries!r}")
    figures = compare_indexes(url, meta.store_id, candidates, asked, vectors, batch=batch, k=k, rounds=rounds)
    return {"store": store, "version": meta.store_id, "queries_from": queries, **figures}
