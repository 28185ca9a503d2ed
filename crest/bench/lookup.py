"""`crest lookup` and `crest bench lookup`: one text's draft tree, SDK lookups timed against a bare prepared lookup.

`lookup_text` encodes a text with the store's tokenizer (or a given one, which must match the store's
fingerprint) and returns the draft tree of the stored suffix the suffix rule picks (`crest_client.choice`), with
that suffix and each node's text piece.
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
from dataclasses import dataclass, field

import numpy as np
import psycopg
from crest_client import Store
from crest_client.choice import built_rule, decided_at_ingest
from crest_client.draft import Draft
from crest_client.store import SPIN

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
        built = built_rule(handle.info.params)
        used = built if decided_at_ingest(handle.info.params) else handle.rule  # decided: the one row fetched drafts
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
    built = built_rule(handle.info.params)
    if not decided_at_ingest(handle.info.params):
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
    asleep_miss_median_us: float  # draft() with spin=0, which sleeps until its answer arrives (a second pass)
    asleep_miss_ratio: float  # against the bare lookup of that pass
    hit_median_us: float
    hit_p99_us: float
    hit_rate_of_contexts: float
    meets_miss_ratio_target: bool = False  # median miss <= 1.3x the bare lookup
    meets_hit_median_us_target: bool = False  # median cache hit < 10 us


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


# the store issue's lookup targets: a miss within 1.3x a bare prepared lookup, a cache hit under 10 us
LOOKUP_TARGETS = {"miss_ratio": 1.3, "hit_median_us": 10.0}


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
        meets_miss_ratio_target=ratio <= LOOKUP_TARGETS["miss_ratio"],
        meets_hit_median_us_target=statistics.median(hits) * us < LOOKUP_TARGETS["hit_median_us"],
    )
