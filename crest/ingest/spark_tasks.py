"""The steps the Spark engine runs on its executors, as plain numpy functions over one partition's arrays.

Nothing here imports pyspark, so each step is tested without a cluster. A token partition holds whole
documents, so every n-gram and every continuation lies inside one partition; only the global position of its
first token (`base`) ties it to the corpus. Counting keeps sorted (key, count) tables split into key ranges
(`split_by_bounds`), so a range's tables merge into its global counts and the global rank of each n-gram
(count descending, key ascending: the in-process rule) follows from per-range count histograms
(`rank_offsets`, `ranks_of`). The occurrence sample keeps, per n-gram, the `max_matches` occurrences with the
smallest (seeded hash of the global position, position): the in-process rule, which merges across partitions
(`bottom_k`). Trees are built from the sampled continuations with the in-process trie builder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from crest_client.codec import TokenTable, encode_tree
from crest_client.keyfilter import hash_keys
from psycopg import sql

from crest import db
from crest.ingest.ngrams import count_ngrams, iter_chunks, run_starts, unpack_keys
from crest.ingest.publishing import peak_rss
from crest.ingest.trees import position_hash, trie_batch

Table = tuple[np.ndarray, np.ndarray]  # (sorted distinct keys [K], counts [K] int64)


def local_counts(
    tokens: np.ndarray, offsets: np.ndarray, *, max_n: int, vocab_size: int, chunk_tokens: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Yield, per n, (n, the partition's sorted distinct keys, their counts, the positions counted)."""
    counts = count_ngrams(tokens, offsets, max_n=max_n, vocab_size=vocab_size, chunk_tokens=chunk_tokens)
    for n in range(1, max_n + 1):  # one record per n: records stay small for the JVM
        yield n, counts.keys[n], counts.counts[n], counts.positions(n)


def spaced_sample(keys: np.ndarray, size: int) -> tuple[np.ndarray, float]:
    """Return up to `size` evenly spaced keys of a sorted table and the number of keys each stands for."""
    if keys.shape[0] <= size:
        return keys.copy(), 1.0
    at = np.linspace(0, keys.shape[0] - 1, size).astype(np.int64)
    return keys[at], keys.shape[0] / size


def bucket_bounds(samples: list[tuple[np.ndarray, float]], buckets: int) -> np.ndarray | None:
    """Return `buckets - 1` ascending key boundaries that split the sampled keys into even ranges."""
    parts = [(keys, np.full(keys.shape[0], weight)) for keys, weight in samples if keys.shape[0]]
    if not parts or buckets < 2:
        return None
    keys = np.concatenate([k for k, _ in parts])
    weights = np.concatenate([w for _, w in parts])
    order = np.argsort(keys, kind="stable")
    keys, cum = keys[order], np.cumsum(weights[order])
    targets = cum[-1] * np.arange(1, buckets) / buckets
    bounds = keys[np.minimum(np.searchsorted(cum, targets), keys.shape[0] - 1)]
    return bounds[np.r_[True, bounds[1:] != bounds[:-1]]]


def bucket_count(bounds: np.ndarray | None) -> int:
    """Return how many key ranges `bounds` make."""
    return 1 if bounds is None else int(bounds.shape[0]) + 1


def split_by_bounds(keys: np.ndarray, counts: np.ndarray, bounds: np.ndarray | None) -> Iterator[tuple[int, Table]]:
    """Yield (range, table) for the non-empty key ranges of a sorted table; range b holds [bounds[b-1], bounds[b])."""
    if bounds is None:
        if keys.shape[0]:
            yield 0, (keys, counts)
        return
    cuts = np.r_[0, np.searchsorted(keys, bounds, side="left"), keys.shape[0]]
    for b in range(cuts.shape[0] - 1):
        lo, hi = int(cuts[b]), int(cuts[b + 1])
        if hi > lo:
            yield b, (keys[lo:hi], counts[lo:hi])


def merge_counts(a: Table, b: Table) -> Table:
    """Merge two sorted (key, count) tables, adding the counts of shared keys."""
    keys = np.concatenate([a[0], b[0]])
    counts = np.concatenate([a[1], b[1]])
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order]
    first = run_starts(keys)
    if first.shape[0] == 0:
        return keys, counts
    return keys[first], np.add.reduceat(counts, first)


def count_histogram(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the distinct count values (ascending) of a table and how many keys have each."""
    values, numbers = np.unique(counts, return_counts=True)
    return values.astype(np.int64), numbers.astype(np.int64)


def rank_offsets(hists: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Return, per key range, (count values, rank of its first key with that count) from per-range histograms.

    The rank of a key is the number of keys with a larger count plus those with the same count and a smaller
    key: the keys with that count in earlier ranges, then the smaller ones in its own range.
    """
    if not hists:
        return {}
    buckets = np.concatenate([np.full(v.shape[0], b, dtype=np.int64) for b, (v, _) in hists.items()])
    values = np.concatenate([v for v, _ in hists.values()])
    numbers = np.concatenate([m for _, m in hists.values()])
    distinct, inverse = np.unique(values, return_inverse=True)
    total = np.bincount(inverse, weights=numbers).astype(np.int64)  # [V] keys per count value
    above = int(total.sum()) - np.cumsum(total)  # [V] keys with a larger count
    order = np.lexsort((buckets, values))
    before = np.zeros(values.shape[0], dtype=np.int64)  # keys with the same count in earlier ranges
    sorted_numbers = numbers[order]
    starts = run_starts(values[order])
    run_first = np.repeat(starts, np.diff(np.r_[starts, order.shape[0]]))
    cum = np.cumsum(sorted_numbers) - sorted_numbers  # exclusive running sum
    before[order] = cum - cum[run_first]
    first_rank = above[inverse] + before
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for b, (v, _) in hists.items():
        mask = buckets == b
        out[b] = (v, first_rank[mask])
    return out


def ranks_of(counts: np.ndarray, offsets: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Return the global rank of each key of one range's sorted table, given its `rank_offsets` entry."""
    values, first_rank = offsets
    order = np.argsort(counts, kind="stable")  # equal counts keep key order
    sorted_counts = counts[order]
    starts = run_starts(sorted_counts)
    within = np.arange(order.shape[0]) - np.repeat(starts, np.diff(np.r_[starts, order.shape[0]]))
    ranks = np.empty(order.shape[0], dtype=np.int64)
    ranks[order] = first_rank[np.searchsorted(values, sorted_counts)] + within
    return ranks


@dataclass
class Sample:
    """Sampled occurrences of selected n-grams with their continuations, sorted by (n-gram, hash, position)."""

    ngram: np.ndarray  # [M] int64, index into the selected keys of one n
    hash: np.ndarray  # [M] uint64, position_hash of the global position
    position: np.ndarray  # [M] int64, global corpus position of the n-gram's first token
    tokens: np.ndarray  # [M, L] int32, continuation tokens, padded
    lengths: np.ndarray  # [M] int32, continuation lengths (clipped at the document end)


def bottom_k(sample: Sample, k: int) -> Sample:
    """Keep, per n-gram, the `k` occurrences with the smallest (hash, position)."""
    order = np.lexsort((sample.position, sample.hash, sample.ngram))
    ngram = sample.ngram[order]
    starts = run_starts(ngram)
    within = np.arange(ngram.shape[0]) - np.repeat(starts, np.diff(np.r_[starts, ngram.shape[0]]))
    keep = order[within < k]
    return Sample(*(column[keep] for column in _columns(sample)))


def merge_samples(a: Sample, b: Sample, k: int) -> Sample:
    """Merge two samples of the same n-grams, keeping the `k` smallest per n-gram."""
    return bottom_k(_join(a, b), k)


def scan_occurrences(
    tokens: np.ndarray,
    offsets: np.ndarray,
    base: int,
    keys: np.ndarray,
    *,
    n: int,
    vocab_size: int,
    max_matches: int,
    seed: int,
    length: int,
    chunk_tokens: int,
) -> Sample:
    """Return the partition's sample of the occurrences of `keys` (sorted packed keys), continuations included."""
    kept = _positions(np.zeros(0, np.int64), np.zeros(0, np.int64))
    if keys.shape[0]:
        for _, chunk, starts in iter_chunks(tokens, offsets, n=n, vocab_size=vocab_size, chunk_tokens=chunk_tokens):
            at = np.minimum(np.searchsorted(keys, chunk), keys.shape[0] - 1)
            hit = keys[at] == chunk
            found = _positions(at[hit].astype(np.int64), starts[hit], base=base, seed=seed)
            kept = _join(kept, found)
            if kept.ngram.shape[0] > 4 * chunk_tokens:  # bounds memory: the sample merges at any point
                kept = bottom_k(kept, max_matches)
    kept = bottom_k(kept, max_matches)
    pos = kept.position
    doc_end = offsets[np.searchsorted(offsets, pos, side="right")]  # [M] end of each occurrence's document
    lengths = np.clip(doc_end - pos - n, 0, length).astype(np.int32)
    grid = pos[:, None] + n + np.arange(length)[None, :]  # [M, L]
    inside = np.arange(length)[None, :] < lengths[:, None]
    conts = np.where(inside, np.asarray(tokens)[np.minimum(grid, max(0, tokens.shape[0] - 1))], 0).astype(np.int32)
    return Sample(kept.ngram, kept.hash, pos + base, conts, lengths)


def _positions(ngram: np.ndarray, position: np.ndarray, *, base: int = 0, seed: int = 0) -> Sample:
    """Return occurrences (local positions) without continuations yet, hashed by their global position."""
    empty = np.zeros((ngram.shape[0], 0), np.int32)
    return Sample(ngram, position_hash(position + base, seed), position, empty, np.zeros(ngram.shape[0], np.int32))


def _join(a: Sample, b: Sample) -> Sample:
    return Sample(*(np.concatenate([x, y]) for x, y in zip(_columns(a), _columns(b), strict=True)))


def _columns(s: Sample) -> tuple[np.ndarray, ...]:
    return s.ngram, s.hash, s.position, s.tokens, s.lengths


def sample_groups(counts: np.ndarray, *, max_matches: int, length: int, groups: int, group_bytes: int) -> np.ndarray:
    """Return the first n-gram index of each group: at least `groups`, each sampling about `group_bytes` at most."""
    expected = np.minimum(counts, max_matches) * (28 + 4 * length)  # [K] bytes of each n-gram's final sample
    total = int(expected.sum())
    count = max(groups, -(-total // group_bytes))
    before = np.cumsum(expected) - expected
    group = np.minimum(before * count // max(1, total), count - 1)
    return np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if counts.shape[0] else np.zeros(1, np.int64)


def split_sample(sample: Sample, edges: np.ndarray) -> Iterator[tuple[int, Sample]]:
    """Yield (group, part) of a sample; group g holds the n-grams [edges[g], edges[g + 1])."""
    group = np.searchsorted(edges, sample.ngram, side="right") - 1
    for g in np.unique(group).tolist():
        m = group == g
        yield int(g), Sample(*(column[m] for column in _columns(sample)))


@dataclass
class Rows:
    """Encoded rows of one n, columnar: what a COPY writes and what the figures count."""

    n: int
    ranks: np.ndarray  # [R] int64
    counts: np.ndarray  # [R] int64
    keys: list[bytes]
    blobs: list[bytes]
    nodes: np.ndarray  # [R] int64
    hashes: np.ndarray  # [R] uint64, key filter hashes

    def take(self, mask: np.ndarray) -> Rows:
        """Return the rows where `mask` holds."""
        at = np.flatnonzero(mask).tolist()
        return Rows(
            self.n,
            self.ranks[mask],
            self.counts[mask],
            [self.keys[i] for i in at],
            [self.blobs[i] for i in at],
            self.nodes[mask],
            self.hashes[mask],
        )


def build_rows(
    sample: Sample,
    *,
    n: int,
    keys: np.ndarray,
    counts: np.ndarray,
    ranks: np.ndarray,
    vocab_size: int,
    width: int,
    table: TokenTable | None,
    blob_format: int,
    tree_size: int,
    length: int,
    batch_occurrences: int = 1 << 20,
) -> Rows:
    """Build and encode the trees of the sampled n-grams (`keys`/`counts`/`ranks`: all selected keys of n)."""
    order = np.lexsort((sample.position, sample.ngram))
    ngram, conts, lengths = sample.ngram[order], sample.tokens[order], sample.lengths[order].astype(np.int64)
    trees, first = np.unique(ngram, return_index=True)
    bounds = np.r_[first, ngram.shape[0]]
    out_idx: list[int] = []
    blobs: list[bytes] = []
    nodes: list[int] = []
    lo = 0
    while lo < trees.shape[0]:
        hi = max(lo + 1, int(np.searchsorted(bounds, bounds[lo] + batch_occurrences, side="right")) - 1)
        hi = min(hi, trees.shape[0])
        a, b = int(bounds[lo]), int(bounds[hi])
        sizes = lengths[a:b] + 1  # each continuation becomes a document [pad, continuation...]
        syn_offsets = np.r_[0, np.cumsum(sizes)]
        syn = np.zeros(int(syn_offsets[-1]), dtype=np.int32)
        inside = np.arange(conts.shape[1])[None, :] < lengths[a:b, None]
        syn[(syn_offsets[:-1, None] + 1 + np.arange(conts.shape[1])[None, :])[inside]] = conts[a:b][inside]
        batch = trie_batch(
            syn,
            syn_offsets,
            np.arange(hi - lo, dtype=np.int64),
            counts[trees[lo:hi]],
            np.repeat(np.arange(hi - lo), np.diff(bounds[lo : hi + 1])),
            syn_offsets[:-1] + 1,
            length=length,
            size=tree_size,
        )
        for j in range(hi - lo):
            s, e = int(batch.offsets[j]), int(batch.offsets[j + 1])
            if s == e:
                continue  # an n-gram with no continuation drafts nothing
            blobs.append(
                encode_tree(
                    batch.tokens[s:e],
                    batch.parents[s:e],
                    batch.weights[s:e],
                    vocab_size=vocab_size,
                    table=table if blob_format == 2 else None,
                    version=blob_format,
                )
            )
            out_idx.append(int(trees[lo + j]))
            nodes.append(e - s)
        lo = hi
    at = np.asarray(out_idx, dtype=np.int64)
    grams = unpack_keys(keys[at], n, vocab_size) if at.shape[0] else np.zeros((0, n), np.int32)
    raw = grams.astype(f">u{width}").tobytes()
    stride = n * width
    return Rows(
        n,
        ranks[at],
        counts[at],
        [raw[i * stride : (i + 1) * stride] for i in range(at.shape[0])],
        blobs,
        np.asarray(nodes, dtype=np.int64),
        hash_keys(grams.astype(np.int64)),
    )


@dataclass
class LoadStats:
    """What one COPY task wrote (or found already written by an earlier attempt), for the figures."""

    kept: dict[int, int]
    covered: dict[int, int]
    nodes: int
    blob_bytes: int
    hashes: np.ndarray  # [R] uint64
    peak_rss_bytes: int
    copied: bool

    def add(self, rows: Rows) -> None:
        """Count `rows` in."""
        self.kept[rows.n] = self.kept.get(rows.n, 0) + len(rows.keys)
        self.covered[rows.n] = self.covered.get(rows.n, 0) + int(rows.counts.sum())
        self.nodes += int(rows.nodes.sum())
        self.blob_bytes += sum(len(b) for b in rows.blobs)
        self.hashes = np.concatenate([self.hashes, rows.hashes])


def copy_rows(dsn: str, store_id: int, marker: int, batches: Iterable[Rows], *, fault: bool = False) -> LoadStats:
    """COPY rows into the version's table once: a retried or speculative attempt finds the marker and skips.

    The marker is a row of the version's vocabulary table (token id -1 - marker, removed before indexing),
    written in the same transaction as the rows, under an advisory lock on (version, marker).
    """
    stats = LoadStats({}, {}, 0, 0, np.zeros(0, np.uint64), 0, copied=False)
    conn = db.connect(dsn)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", ((int(store_id) << 24) | int(marker),))
            done = conn.execute(
                sql.SQL("SELECT 1 FROM {} WHERE token_id = %s").format(db.vocab_table(store_id)), (-1 - marker,)
            ).fetchone()
            query = sql.SQL("COPY {} (store_id, count, n, key, tree) FROM STDIN (FORMAT BINARY)").format(
                db.ngram_table(store_id)
            )
            with conn.cursor() as cur, cur.copy(query) as copy:
                copy.set_types(["int4", "int4", "int2", "bytea", "bytea"])
                for rows in batches:
                    stats.add(rows)
                    if done:
                        continue
                    for count, key, blob in zip(rows.counts.tolist(), rows.keys, rows.blobs, strict=True):
                        copy.write_row((store_id, count, rows.n, key, blob))
                    if fault:
                        raise RuntimeError("fault injected in a COPY task (CREST_SPARK_FAULT=copy)")
            if not done:
                conn.execute(
                    sql.SQL("INSERT INTO {} (store_id, token_id, piece) VALUES (%s, %s, '')").format(
                        db.vocab_table(store_id)
                    ),
                    (store_id, -1 - marker),
                )
                stats.copied = True
    finally:
        conn.close()
    stats.peak_rss_bytes = peak_rss()
    return stats
