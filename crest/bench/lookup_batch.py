"""`crest bench lookup --batch`: `draft_many` timed for batches of contexts, split into its parts.

`bench_batch` times the SDK's `draft_many` on cache misses for batches of contexts (a serving step's lookups: one
pipelined round trip, decoding included) and splits a batch's time into key hashing, tree decoding and the rest
(the round trip). The contexts are the ones `crest.bench.lookup.sample_contexts` draws for the single-lookup
timing; the figures go into the one results format like every benchmark's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import psycopg
from crest_client import Store
from crest_client.batch_codec import decode_trees
from crest_client.lookup import candidate_keys, probe_sql

from crest.bench.lookup import percentile, sample_contexts


@dataclass
class BatchFigures:
    """Latency of `Store.draft_many` on cache misses for batches of contexts, per batch and per context."""

    batch: int
    batches: int
    drafts_per_batch: float
    batch_median_ms: float
    batch_p99_ms: float
    context_median_us: float
    context_p99_us: float
    keys_median_ms: float  # of a batch: hashing the contexts' suffixes through the key filter
    decode_median_ms: float  # of a batch: decoding its tree blobs into drafts
    round_trip_median_ms: float  # of a batch: the rest (the pipelined queries, psycopg, the server)


def bench_batch(
    dsn: str, store: str, *, batch: int = 64, samples: int = 2000, max_nodes: int = 64, seed: int = 0
) -> BatchFigures:
    """Time `draft_many` for batches of `batch` contexts on cache misses, and split it into keys, decode, the rest."""
    from crest.errors import ConfigError

    if batch < 1 or samples < 1:
        raise ConfigError("--batch and --samples must be positive")
    contexts, _ = sample_contexts(dsn, store, samples=max(samples, batch), seed=seed)
    if not contexts:
        raise ConfigError(f"store {store!r} has no n-gram to look up")
    while len(contexts) < batch:  # a small store: repeat its contexts (still misses: no cache)
        contexts += contexts
    groups = [contexts[i : i + batch] for i in range(0, len(contexts) - batch + 1, batch)]
    whole: list[float] = []
    keys: list[float] = []
    decode: list[float] = []
    found = 0
    with Store.connect(dsn, store, cache_size=0, timeout=5.0, pool_size=1) as handle:
        blobs = _stored_trees(dsn, handle, groups)
        for group in groups[:3]:  # warm up: prepare the statements, load the pool
            handle.draft_many(group, max_nodes)
        rounds = max(1, -(-100 // len(groups)))  # at least 100 batches
        for group, rows in [pair for _ in range(rounds) for pair in zip(groups, blobs, strict=True)]:
            t0 = time.perf_counter()
            drafts = handle.draft_many(group, max_nodes)
            whole.append(time.perf_counter() - t0)
            found += sum(d is not None for d in drafts)
            t0 = time.perf_counter()
            candidate_keys([ctx[-handle.info.max_n :] for ctx in group], handle.info)
            keys.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decode_trees([tree for _, tree in rows], [n for n, _ in rows], table=handle.info.table)
            decode.append(time.perf_counter() - t0)
    ms = 1e3
    median = statistics.median(whole)
    return BatchFigures(
        batch=batch,
        batches=len(whole),
        drafts_per_batch=found / len(whole),
        batch_median_ms=median * ms,
        batch_p99_ms=percentile(whole, 99) * ms,
        context_median_us=median / batch * 1e6,
        context_p99_us=percentile(whole, 99) / batch * 1e6,
        keys_median_ms=statistics.median(keys) * ms,
        decode_median_ms=statistics.median(decode) * ms,
        round_trip_median_ms=max(0.0, median - statistics.median(keys) - statistics.median(decode)) * ms,
    )


def _stored_trees(dsn: str, handle: Store, groups: list[list[list[int]]]) -> list[list[tuple[int, bytes]]]:
    """Return, per batch, the (n, tree blob) rows its lookups find, read with a plain connection."""
    out: list[list[tuple[int, bytes]]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for group in groups:
            rows = []
            for ctx in group:
                keys = handle.candidate_keys(ctx[-handle.info.max_n :])
                if not keys:
                    continue
                row = conn.execute(probe_sql(handle.info.id, len(keys)), keys, binary=True).fetchone()
                if row is not None:  # (0, 0, n, count, tree)
                    rows.append((int(row[2]), bytes(row[4])))
            out.append(rows)
    return out
