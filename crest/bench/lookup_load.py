"""`crest bench lookup --seconds`: the SDK driven from threads and processes for a fixed time.

`bench_load` starts `processes` spawned processes, each with one `Store` shared by `concurrency` threads that
draft random contexts (drawn by `crest.bench.lookup.sample_contexts`) until the deadline, and reports
throughput, latency percentiles and errors; a process that dies or sends nothing fails the run with a clear
error instead of a hang.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from crest_client import Store

from crest.bench.lookup import sample_contexts
from crest.errors import StoreNotFound


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
