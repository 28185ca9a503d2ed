"""`crest lookup` and `crest bench lookup`: one text's draft tree, SDK lookups timed against a bare prepared lookup.

`lookup_text` encodes a text with the store's tokenizer (or a given one, which must match the store's
fingerprint) and returns the draft tree of the stored suffix the suffix rule picks (`crest_client.choice`), with
that suffix and each node's text piece.
`bench_lookup` times the SDK's `draft()` on cache misses side by side with a bare prepared single-row psycopg
lookup of the same rows on the same server, and the cache-hit path; `bench_batch` times `draft_many` for
batches of contexts (a serving step's lookups: one pipelined round trip, decoding included) and splits a batch's
time into key hashing, tree decoding and the rest (the round trip); `bench_load` drives the SDK from threads
and processes for a fixed time and reports throughput, latency percentiles and errors.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from crest_client import Store
from crest_client.batch_codec import decode_trees
from crest_client.draft import Draft
from crest_client.lookup import candidate_keys, probe_sql

from crest.config import check_store_name, resolve_model_spec
from crest.db.versions import ngram_table, session
from crest.errors import FingerprintMismatch, StoreNotFound

LOOKUP_TIMEOUT = 5.0  # seconds for `crest lookup` to connect and read the store, and for its one draft()


@dataclass
class TextLookup:
    """The draft tree stored for the end of a text, with each node's text piece (empty when none matched)."""

    draft: Draft | None
    pieces: list[str]
    rule: str = "expected"  # the suffix rule that picked the suffix
    suffix_ids: list[int] = field(default_factory=list)  # the matched suffix: the text's last draft.n tokens
    suffix_pieces: list[str] = field(default_factory=list)
    source: str = ""  # where the matched row's tree came from (the store's --suffix-rule)


def lookup_text(
    dsn: str,
    store: str,
    text: str,
    *,
    tokenizer: str | None = None,
    max_nodes: int = 64,
    rule: str | None = None,
    timeout: float = LOOKUP_TIMEOUT,
) -> TextLookup:
    """Return the tree for the stored suffix of `text` that `rule` picks (tokenizer: the store's own unless given)."""
    from crest.decoding.tokenizer import load_tokenizer

    check_store_name(store)
    with Store.connect(dsn, store, cache_size=0, timeout=timeout, connect_timeout=timeout, rule=rule) as handle:
        tok = load_tokenizer(resolve_model_spec(tokenizer or handle.info.tokenizer))
        if tok.fingerprint != handle.info.fingerprint:
            raise FingerprintMismatch(f"store {store!r} was built with another tokenizer than {tok.spec!r}")
        ids = tok.encode(text)
        draft = handle.draft(ids, max_nodes=max_nodes, tier="static")  # the published version's own row
        used = handle.rule
        source = tree_source(dsn, handle, ids[len(ids) - draft.n :] if draft is not None and draft.n else [], used)
    tokens = draft.tokens.tolist() if draft is not None else []
    suffix = ids[len(ids) - draft.n :] if draft is not None and draft.n else []
    return TextLookup(
        draft=draft,
        pieces=[tok.hf.decode([int(t)]) for t in tokens],
        rule=used,
        suffix_ids=[int(t) for t in suffix],
        suffix_pieces=[tok.hf.decode([int(t)]) for t in suffix],
        source=source,
    )


def tree_source(dsn: str, handle: Store, suffix: list[int], rule: str) -> str:
    """Return where the matched suffix's stored tree came from: its own n-gram's, or decided at ingest."""
    if not suffix:
        return ""
    built = str(handle.info.params.get("suffix_rule", "lookup"))
    if built == "lookup":
        return f"its own occurrences (the {rule} rule chose this suffix at lookup)"
    keys = handle.candidate_keys(suffix)  # the matched n-gram and its suffixes the filter may hold, longest first
    query = psycopg.sql.SQL("SELECT n, count FROM {} WHERE key = ANY(%s) ORDER BY n DESC").format(
        psycopg.sql.Identifier(f"crest_ngrams_s{handle.info.id}")
    )
    chosen = ""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(query, (keys,)).fetchall()
        if built == "auto":  # which rule the build chose on its held-out slice (crest.ingest.suffix_choice)
            got = conn.execute("SELECT figures->'suffix_choice' FROM crest_stores WHERE id = %s", (handle.info.id,))
            chosen = ((got.fetchone() or [None])[0] or {}).get("rule", "?")
    counts = {int(n): int(c) for n, c in rows}
    own = counts.pop(len(suffix), 0)
    shorter = ", ".join(f"n={n}: seen {c}" for n, c in counts.items())
    if built == "auto" and chosen == "longest":
        return f"its own occurrences (seen {own}): the longest stored suffix, the rule auto chose at ingest"
    if built == "auto":
        built = "auto: prune"
    if built in ("prune", "auto: prune"):
        return f"its own occurrences (seen {own}), kept at ingest ({built}): the suffix the expected rule chooses, " + (
            f"over its kept shorter suffixes ({shorter})" if shorter else "no shorter suffix is kept"
        )
    if not shorter:
        return f"decided at ingest ({built}): its own occurrences (seen {own}); no shorter suffix is stored"
    return f"decided at ingest ({built}): its own occurrences (seen {own}) backed off to its suffixes' ({shorter})"


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
    meets_miss_ratio_target: bool = False  # median miss <= 1.3x the bare lookup
    meets_hit_median_us_target: bool = False  # median cache hit < 10 us


def _pct(values: list[float], q: float) -> float:
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


# the store issue's lookup targets: a miss within 1.3x a bare prepared lookup, a cache hit under 10 us
LOOKUP_TARGETS = {"miss_ratio": 1.3, "hit_median_us": 10.0}


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
    ratio = statistics.median(miss) / statistics.median(bare)
    return LookupFigures(
        samples=len(contexts),
        bare_median_us=statistics.median(bare) * us,
        bare_p99_us=_pct(bare, 99) * us,
        miss_median_us=statistics.median(miss) * us,
        miss_p99_us=_pct(miss, 99) * us,
        miss_ratio=ratio,
        hit_median_us=statistics.median(hits) * us,
        hit_p99_us=_pct(hits, 99) * us,
        hit_rate_of_contexts=found / max(1, len(contexts)),
        meets_miss_ratio_target=ratio <= LOOKUP_TARGETS["miss_ratio"],
        meets_hit_median_us_target=statistics.median(hits) * us < LOOKUP_TARGETS["hit_median_us"],
    )


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
    meets_batch_ms_target: bool = False  # median batch of 64 under 2 ms


BATCH_TARGET_MS = 2.0  # the serving issue's target for a batch of 64 contexts


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
        batch_p99_ms=_pct(whole, 99) * ms,
        context_median_us=median / batch * 1e6,
        context_p99_us=_pct(whole, 99) / batch * 1e6,
        keys_median_ms=statistics.median(keys) * ms,
        decode_median_ms=statistics.median(decode) * ms,
        round_trip_median_ms=max(0.0, median - statistics.median(keys) - statistics.median(decode)) * ms,
        meets_batch_ms_target=median * ms < BATCH_TARGET_MS * batch / 64,
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


@dataclass
class LoadFigures:
    """Throughput and latency of many threads in several processes drafting against one server."""

    processes: int
    threads_per_process: int
    seconds: float
    cache: bool
    lookups: int
    drafts: int
    errors: int
    lookups_per_second: float
    median_us: float
    p99_us: float
    max_us: float


def bench_load(
    dsn: str,
    store: str,
    *,
    concurrency: int = 8,
    processes: int = 1,
    seconds: float = 10.0,
    samples: int = 2000,
    max_nodes: int = 64,
    cache: bool = False,
    timeout: float = 1.0,
    seed: int = 0,
) -> LoadFigures:
    """Run `processes` processes of `concurrency` threads drafting for `seconds`; return throughput and latency."""
    import multiprocessing

    from crest.errors import ConfigError

    if concurrency < 1 or processes < 1 or seconds <= 0 or samples < 1:
        raise ConfigError("--concurrency, --processes, --seconds and --samples must be positive")
    contexts, _ = sample_contexts(dsn, store, samples=samples, seed=seed)
    if not contexts:
        raise ConfigError(f"store {store!r} has no n-gram to look up")
    mp = multiprocessing.get_context("spawn")  # no pool, lock or thread is inherited half-copied
    ready, go, results = mp.Queue(), mp.Event(), mp.Queue()
    job = (dsn, store, contexts, concurrency, seconds, max_nodes, cache, timeout)
    workers = [mp.Process(target=_load_process, args=(*job, seed + i, ready, go, results)) for i in range(processes)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:  # every process connected and warmed up
            failure = _receive(ready, workers, timeout=120)
            if failure:
                raise StoreNotFound(failure)
        go.set()
        parts = [_receive(results, workers, timeout=seconds + 120) for _ in workers]
    finally:
        go.set()
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    latencies = np.concatenate([p["latencies"] for p in parts]) if parts else np.zeros(0)
    lookups = int(latencies.size)
    wall = max(p["wall"] for p in parts)
    return LoadFigures(
        processes=processes,
        threads_per_process=concurrency,
        seconds=wall,
        cache=cache,
        lookups=lookups,
        drafts=sum(p["drafts"] for p in parts),
        errors=sum(p["errors"] for p in parts),
        lookups_per_second=lookups / max(wall, 1e-9),
        median_us=float(np.median(latencies)) * 1e6 if lookups else 0.0,
        p99_us=float(np.percentile(latencies, 99)) * 1e6 if lookups else 0.0,
        max_us=float(latencies.max()) * 1e6 if lookups else 0.0,
    )


def _receive(queue: Any, workers: list[Any], *, timeout: float) -> Any:
    """Return the next item of `queue`, failing early when a worker process died without sending it."""
    import queue as queues

    from crest.errors import CrestError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except queues.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise CrestError(f"a load process died (exit code {dead[0]})") from None
    raise CrestError(f"the load processes sent nothing within {timeout:.0f} s")


def _load_process(
    dsn: str,
    store: str,
    contexts: list[list[int]],
    threads: int,
    seconds: float,
    max_nodes: int,
    cache: bool,
    timeout: float,
    seed: int,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """One load process: a `Store` shared by `threads` threads that draft random contexts until the deadline."""
    import threading

    try:
        handle = Store.connect(
            dsn, store, cache_size=len(contexts) + 1 if cache else 0, timeout=timeout, pool_size=threads
        )
    except Exception as exc:
        ready.put(f"load process cannot open store {store!r}: {exc}")
        return
    with handle:
        for ctx in contexts[:50]:
            handle.draft(ctx, max_nodes)  # prepare the statement, fill the pool
        handle.stats.update(lookups=0, hits=0, errors=0)
        per_thread: list[list[float]] = [[] for _ in range(threads)]
        drafts = [0] * threads
        raised = [0] * threads

        def run(slot: int) -> None:
            rng = random.Random(seed * 1000 + slot)
            times, pick, clock = per_thread[slot], rng.randrange, time.perf_counter
            go.wait()
            deadline = clock() + seconds
            while clock() < deadline:
                ctx = contexts[pick(len(contexts))]
                t0 = clock()
                try:
                    draft = handle.draft(ctx, max_nodes)
                except Exception:
                    raised[slot] += 1
                    continue
                times.append(clock() - t0)
                drafts[slot] += draft is not None

        pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for thread in pool:
            thread.start()
        ready.put("")
        go.wait()
        t0 = time.perf_counter()
        for thread in pool:
            thread.join()
        wall = time.perf_counter() - t0
        results.put(
            {
                "latencies": np.asarray([t for times in per_thread for t in times], dtype=np.float64),
                "drafts": sum(drafts),
                "errors": int(handle.stats["errors"]) + sum(raised),
                "wall": wall,
            }
        )
