"""`crest bench`: benchmarks that print figures (never timed tests).

`bench_lookup` times the SDK's `draft()` on cache misses side by side with a bare prepared single-row
psycopg lookup of the same rows on the same server, and the cache-hit path. `bench_ingest` runs a full
ingest and reports throughput per stage and peak memory.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psycopg
from crest_client import Store

from crest.db import ngram_table, session
from crest.errors import StoreNotFound


@dataclass
class LookupFigures:
    """Latency figures of one lookup benchmark run, in microseconds."""

    samples: int
    bare_median_us: float
    bare_p99_us: float
    miss_median_us: float
    miss_p99_us: float
    miss_ratio: float
    hit_median_us: float
    hit_p99_us: float
    hit_rate_of_contexts: float

    def to_json(self) -> str:
        """Return the figures as JSON."""
        return json.dumps(asdict(self))


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def sample_contexts(dsn: str, store: str, *, samples: int, seed: int = 0) -> tuple[list[list[int]], list[bytes]]:
    """Return contexts ending in stored n-grams (random tokens before them) and the stored keys they end in."""
    with session(dsn) as conn:
        row = conn.execute(
            "SELECT id, token_width, vocab_size FROM crest_stores WHERE name = %s AND state = 'published'", (store,)
        ).fetchone()
        if row is None:
            raise StoreNotFound(f"no published store named {store!r}")
        sid, width, vocab = row
        keys = [
            bytes(k)
            for (k,) in conn.execute(
                psycopg.sql.SQL("SELECT key FROM {} ORDER BY md5(key::text || %s) LIMIT %s").format(ngram_table(sid)),
                (str(seed), samples),
            )
        ]
    rng = random.Random(seed)
    contexts = []
    for key in keys:
        tokens = np.frombuffer(key, dtype=f">u{width}").astype(np.int64).tolist()
        contexts.append([rng.randrange(vocab) for _ in range(16)] + tokens)
    return contexts, keys


def bench_lookup(dsn: str, store: str, *, samples: int = 2000, max_nodes: int = 64, seed: int = 0) -> LookupFigures:
    """Time draft() misses against a bare prepared lookup, interleaved, plus cache hits."""
    contexts, keys = sample_contexts(dsn, store, samples=samples, seed=seed)
    with Store.connect(dsn, store, cache_size=0, timeout=5.0, pool_size=1) as nocache:
        table = ngram_table(nocache.info.id)
        bare_sql = psycopg.sql.SQL("SELECT tree FROM {} WHERE key = %s").format(table)
        bare: list[float] = []
        miss: list[float] = []
        found = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            for ctx in contexts[: min(50, len(contexts))]:  # warm both paths, prepare both statements
                conn.execute(bare_sql, (keys[0],), prepare=True, binary=True).fetchone()
                nocache.draft(ctx, max_nodes)
            for i, (ctx, key) in enumerate(zip(contexts, keys, strict=True)):
                order = (0, 1) if i % 2 else (1, 0)  # alternate which path runs first
                for which in order:
                    t0 = time.perf_counter()
                    if which == 0:
                        conn.execute(bare_sql, (key,), prepare=True, binary=True).fetchone()
                        bare.append(time.perf_counter() - t0)
                    else:
                        draft = nocache.draft(ctx, max_nodes)
                        miss.append(time.perf_counter() - t0)
                        found += draft is not None
    hits: list[float] = []
    with Store.connect(dsn, store, cache_size=len(contexts) + 1, timeout=5.0, pool_size=1) as cached:
        for ctx in contexts:
            cached.draft(ctx, max_nodes)
        for ctx in contexts:
            t0 = time.perf_counter()
            cached.draft(ctx, max_nodes)
            hits.append(time.perf_counter() - t0)
    us = 1e6
    return LookupFigures(
        samples=len(contexts),
        bare_median_us=statistics.median(bare) * us,
        bare_p99_us=_pct(bare, 99) * us,
        miss_median_us=statistics.median(miss) * us,
        miss_p99_us=_pct(miss, 99) * us,
        miss_ratio=statistics.median(miss) / statistics.median(bare),
        hit_median_us=statistics.median(hits) * us,
        hit_p99_us=_pct(hits, 99) * us,
        hit_rate_of_contexts=found / max(1, len(contexts)),
    )
