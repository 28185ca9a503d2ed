"""`crest bench lookup`: SDK lookups timed against a bare prepared lookup.

`bench_lookup` times the SDK's `draft()` on cache misses side by side with a bare prepared single-row psycopg
lookup of the same rows on the same server; a second pass does the same with a handle that never busy-polls for
its answer (`spin=0`), so what the poll buys is seen in one run; then the cache-hit path. `sample_contexts` draws
the contexts it looks up, which the batch timing (`crest.bench.lookup_batch`, `--batch`) and the load run
(`crest.bench.lookup_load`, `--seconds`) draw too.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
import psycopg
from crest_client import Store
from crest_client.store import SPIN

from crest.db.versions import ngram_table, session
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
    asleep_miss_median_us: float  # draft() with spin=0, which sleeps until its answer arrives (a second pass)
    asleep_miss_ratio: float  # against the bare lookup of that pass
    hit_median_us: float
    hit_p99_us: float
    hit_rate_of_contexts: float


def _interleave(
    dsn: str, store: str, contexts: list[list[int]], keys: list[bytes], *, max_nodes: int, spin: float
) -> tuple[list[float], list[float], int]:
    """Time a bare prepared lookup and draft() on a cache miss, alternating; return both timings and the hits."""
    with Store.connect(dsn, store, cache_size=0, timeout=5.0, pool_size=1, spin=spin) as nocache:
        bare_sql = psycopg.sql.SQL("SELECT tree FROM {} WHERE key = %s").format(ngram_table(nocache.info.id))
        bare: list[float] = []
        miss: list[float] = []
        found = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            for ctx in contexts[: min(50, len(contexts))]:  # warm both paths, prepare both statements
                conn.execute(bare_sql, (keys[0],), prepare=True, binary=True).fetchone()
                nocache.draft(ctx, max_nodes)
            for i, (ctx, key) in enumerate(zip(contexts, keys, strict=True)):
                for which in (0, 1) if i % 2 else (1, 0):  # alternate which path runs first
                    t0 = time.perf_counter()
                    if which == 0:
                        conn.execute(bare_sql, (key,), prepare=True, binary=True).fetchone()
                        bare.append(time.perf_counter() - t0)
                    else:
                        draft = nocache.draft(ctx, max_nodes)
                        miss.append(time.perf_counter() - t0)
                        found += draft is not None
    return bare, miss, found


def percentile(values: list[float], q: float) -> float:
    """Return the `q`th percentile of `values`."""
    return float(np.percentile(np.asarray(values), q))


def sample_contexts(dsn: str, store: str, *, samples: int, seed: int = 0) -> tuple[list[list[int]], list[bytes]]:
    """Return contexts ending in stored n-grams (random tokens before them) and the stored keys they end in."""
    with session(dsn) as conn:
        row = conn.execute(
            "SELECT id, token_width, vocab_size FROM crest_stores WHERE name = %s AND tier = 'static'"
            " AND state = 'published'",
            (store,),
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
    bare, miss, found = _interleave(dsn, store, contexts, keys, max_nodes=max_nodes, spin=SPIN)
    bare_asleep, slept, _ = _interleave(dsn, store, contexts, keys, max_nodes=max_nodes, spin=0.0)
    hits: list[float] = []
    with Store.connect(dsn, store, cache_size=len(contexts) + 1, timeout=5.0, pool_size=1) as cached:
        for ctx in contexts:
            cached.draft(ctx, max_nodes)
        for ctx in contexts:
            t0 = time.perf_counter()
            cached.draft(ctx, max_nodes)
            hits.append(time.perf_counter() - t0)
    us = 1e6
    ratio = statistics.median(miss) / statistics.median(bare)
    return LookupFigures(
        samples=len(contexts),
        bare_median_us=statistics.median(bare) * us,
        bare_p99_us=percentile(bare, 99) * us,
        miss_median_us=statistics.median(miss) * us,
        miss_p99_us=percentile(miss, 99) * us,
        miss_ratio=ratio,
        asleep_miss_median_us=statistics.median(slept) * us,
        asleep_miss_ratio=statistics.median(slept) / statistics.median(bare_asleep),
        hit_median_us=statistics.median(hits) * us,
        hit_p99_us=percentile(hits, 99) * us,
        hit_rate_of_contexts=found / max(1, len(contexts)),
    )
