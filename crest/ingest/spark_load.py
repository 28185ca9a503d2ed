"""Loading rank blocks on Spark: select the n-grams of a block, sample, build and COPY their rows on executors.

The driver collects the selected keys of one block (to broadcast them), sums the estimated bytes of the block's
rows per rank segment (with `--budget`: the ranks that fit follow, as in-process, from the cumulative bytes; under
`--suffix-rule prune` from the bytes left after pruning, `crest.ingest.pruned_budget`, for which it collects each
row's key, rank, promise and size), and collects what each COPY task wrote; the rows themselves stay on the
executors (with `--suffix-rule prune`, each copied row's key and rank too, for `spark_prune`; with `auto`, in case
it chooses `prune`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from crest_client.choice import promise
from crest_client.codec import TokenTable

from crest.config import IngestOptions
from crest.ingest.disk import estimate_row_bytes, fit_count, fixed_bytes, rank_blocks
from crest.ingest.loader import Reporter, SilentReporter
from crest.ingest.ngrams import lengths_for
from crest.ingest.pruned_budget import PrunedBytes
from crest.ingest.spark_prune import row_records
from crest.ingest.spark_tasks import (
    LoadStats,
    Rows,
    build_rows,
    copy_rows,
    merge_samples,
    sample_groups,
    scan_occurrences,
    split_sample,
)

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext

ENV_FAULT = "CREST_SPARK_FAULT"  # test hook: `copy` makes the last COPY task of the first block fail
GROUP_BYTES = 32 << 20  # planned bytes of one group's occurrence sample (the shuffle's record size)


@dataclass
class Plan:
    """What the load steps need to know of the job."""

    sc: SparkContext
    dsn: str
    options: IngestOptions
    vocab_size: int
    width: int
    partitions: int
    chunk_tokens: int
    reporter: Reporter = field(default_factory=SilentReporter)
    figures: dict[str, Any] = field(default_factory=dict)


class Loader:
    """Selects rank blocks, samples their occurrences, builds their rows and has the executors COPY them."""

    def __init__(
        self, job: Plan, parts: RDD[Any], ranked: RDD[Any], store_id: int, bases: np.ndarray, unigram: Any, keep: Any
    ) -> None:
        self.job, self.parts, self.ranked, self.store_id, self.keep = job, parts, ranked, store_id, keep
        self.bases = job.sc.broadcast(bases)
        self.unigram = job.sc.broadcast(unigram)
        self.fixed = fixed_bytes(4 * int(np.count_nonzero(unigram)))  # the version's token table: its seen tokens
        opts = job.options
        self.ns = lengths_for(range(1, opts.max_n + 1), mode=opts.selection, n=opts.single_n)
        self.stats: list[LoadStats] = []
        self.block = 0
        self.fault = os.environ.get(ENV_FAULT) == "copy"
        self.records: RDD[Any] | None = None  # (key, spark_prune.Record) of the rows copied, to prune them
        job.figures["sample_shuffle_bytes"] = 0

    def load_all(self, counted: dict[int, int]) -> int | None:
        """Load the top-t ranks, or the rank blocks that fit the budget; return T."""
        opts = self.job.options
        advance = self.job.reporter.stage("build trees + load", None)
        if opts.budget is None:
            assert opts.top_t is not None
            rows = self._rows(0, opts.top_t)
            self._copy(rows, opts.top_t)
            advance(sum(s.copied for s in self.stats))
            return opts.top_t
        ceiling = max(counted[n] for n in self.ns)
        pruned = PrunedBytes(self.job.width) if opts.suffix_rule == "prune" else None  # fill it with the rows kept
        spent = np.zeros(2, dtype=np.int64)  # the bytes and rows loaded
        for lo, hi in rank_blocks(ceiling):
            rows = self._rows(lo, hi)
            if pruned is None:
                fit, block = self._fit(rows, lo, hi, spent, opts.budget)
            else:
                fit, block = self._fit_pruned(rows, lo, hi, pruned, opts.budget), np.zeros(2, dtype=np.int64)
            self._copy(rows, lo + fit)
            if fit < hi - lo:
                return lo + fit
            spent = spent + block
        return ceiling

    def _rows(self, lo: int, hi: int) -> RDD[Any]:
        """Return the persisted encoded rows of the n-grams ranked [lo, hi) of each n selected."""
        job, ns = self.job, self.ns
        picked = (
            self.ranked.filter(lambda kv: kv[0][0] in ns).map(lambda kv: (kv[0][0], _in_ranks(kv[1], lo, hi))).collect()
        )
        selected: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for n in ns:
            got = [t for m, t in picked if m == n and t[0].shape[0]]
            if not got:
                continue
            keys, counts, ranks = (np.concatenate(c) for c in zip(*got, strict=True))
            order = np.argsort(keys, kind="stable")
            selected[n] = (keys[order], counts[order], ranks[order])
        opts = job.options
        edges = {
            n: sample_groups(
                c,
                max_matches=opts.max_matches,
                length=opts.continuation_length,
                groups=job.partitions,
                group_bytes=GROUP_BYTES,
            )
            for n, (_, c, _) in selected.items()
        }
        sel = job.sc.broadcast((selected, edges))
        bases, unigram = self.bases, self.unigram
        vocab, width, chunk = job.vocab_size, job.width, job.chunk_tokens
        shuffled = job.sc.accumulator(0)

        def samples(part: Any) -> Iterator[Any]:
            index, tokens, offsets = part
            chosen, cuts = sel.value
            for n, (keys, _, _) in chosen.items():
                found = scan_occurrences(
                    tokens,
                    offsets,
                    int(bases.value[index]),
                    keys,
                    n=n,
                    vocab_size=vocab,
                    max_matches=opts.max_matches,
                    seed=opts.seed,
                    length=opts.continuation_length,
                    chunk_tokens=chunk,
                )
                shuffled.add(int(found.ngram.shape[0]) * (28 + 4 * opts.continuation_length))
                for g, piece in split_sample(found, cuts[n]):
                    yield (n, g), piece

        def encode(item: Any) -> Rows:
            (n, _), sample = item
            keys, counts, ranks = sel.value[0][n]
            table = TokenTable.from_counts(unigram.value) if opts.blob_format == 2 else None
            return build_rows(
                sample,
                n=n,
                keys=keys,
                counts=counts,
                ranks=ranks,
                vocab_size=vocab,
                width=width,
                table=table,
                blob_format=opts.blob_format,
                tree_size=opts.tree_size,
                length=opts.continuation_length,
            )

        k = opts.max_matches
        rows = (
            self.parts.flatMap(samples)
            .reduceByKey(lambda a, b: merge_samples(a, b, k), numPartitions=job.partitions)
            .map(encode)
            .persist(self.keep)
        )
        rows.count()
        job.figures["sample_shuffle_bytes"] += shuffled.value
        return rows

    def _fit(self, rows: RDD[Any], lo: int, hi: int, spent: np.ndarray, budget: int) -> tuple[int, np.ndarray]:
        """Return how many ranks of [lo, hi) fit after `spent` [bytes, rows], and the block's [bytes, rows]."""
        span, width, fixed = hi - lo, self.job.width, self.fixed
        coarse = min(span, 4096)

        def seg_start(s: int) -> int:
            return -(-s * span // coarse)  # first rank offset of segment s

        def per_segment(r: Rows) -> np.ndarray:
            out = np.zeros((2, coarse), dtype=np.int64)  # [bytes, rows] per segment
            at = (r.ranks - lo) * coarse // span
            np.add.at(out[0], at, _row_bytes(r, width))
            np.add.at(out[1], at, 1)
            return out

        seg = rows.map(per_segment).fold(np.zeros((2, coarse), dtype=np.int64), lambda a, b: a + b)
        cum = spent[:, None] + np.cumsum(seg, axis=1)  # [2, coarse]
        s = fit_count(cum[0], cum[1], budget=budget, fixed=fixed)  # the segment the budget runs out in
        if s == coarse:
            return span, seg.sum(axis=1)
        a, b = seg_start(s), seg_start(s + 1)

        def per_rank(r: Rows) -> np.ndarray:
            out = np.zeros((2, b - a), dtype=np.int64)
            m = (r.ranks >= lo + a) & (r.ranks < lo + b)
            np.add.at(out[0], r.ranks[m] - lo - a, _row_bytes(r, width)[m])
            np.add.at(out[1], r.ranks[m] - lo - a, 1)
            return out

        fine = rows.map(per_rank).fold(np.zeros((2, b - a), dtype=np.int64), lambda x, y: x + y)
        before = cum[:, s - 1] if s else spent
        within = before[:, None] + np.cumsum(fine, axis=1)
        return a + fit_count(within[0], within[1], budget=budget, fixed=fixed), seg.sum(axis=1)

    def _fit_pruned(self, rows: RDD[Any], lo: int, hi: int, pruned: PrunedBytes, budget: int) -> int:
        """Return how many ranks of [lo, hi) fit the budget once pruned (the block's rows' figures on the driver)."""
        width, k = self.job.width, self.job.options.max_matches

        def meta(r: Rows) -> Iterator[tuple[bytes, int, float, int]]:
            sizes = _row_bytes(r, width).tolist()
            columns = (r.keys, r.ranks.tolist(), r.counts.tolist(), r.blobs, sizes)
            for key, at, count, blob, size in zip(*columns, strict=True):
                yield key, at, promise(r.n, count, blob, max_matches=k), size

        got = rows.flatMap(meta).collect()  # ~110 bytes a row; PrunedBytes keeps ~400
        keys, ranks, promises, sizes = (list(c) for c in zip(*got, strict=True)) if got else ([], [], [], [])
        cum, kept = pruned.block(lo, hi, keys=keys, ranks=ranks, promises=promises, sizes=sizes)
        return fit_count(cum, kept, budget=budget, fixed=self.fixed)

    def _copy(self, rows: RDD[Any], limit: int) -> None:
        """Have each row partition COPY its rows ranked below `limit` (once, whatever the retries)."""
        dsn, sid, block, last = self.job.dsn, self.store_id, self.block, self.job.partitions - 1
        fault = self.fault and block == 0

        def copy(index: int, items: Iterable[Rows]) -> Iterator[LoadStats]:
            batches = (r.take(r.ranks < limit) for r in items)
            yield copy_rows(dsn, sid, (block << 16) | index, batches, fault=fault and index == last)

        self.stats.extend(rows.mapPartitionsWithIndex(copy).collect())
        if self.job.options.suffix_rule in ("prune", "auto"):  # what crest.ingest.spark_prune needs of each row
            k = self.job.options.max_matches
            kept = rows.flatMap(lambda r: row_records(r.take(r.ranks < limit), max_matches=k)).persist(self.keep)
            kept.count()
            self.records = kept if self.records is None else self.records.union(kept)
        rows.unpersist()
        self.block += 1


def _in_ranks(table: tuple[np.ndarray, ...], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys, counts, ranks = table
    m = (ranks >= lo) & (ranks < hi)
    return keys[m], counts[m], ranks[m]


def _row_bytes(rows: Rows, width: int) -> np.ndarray:
    return estimate_row_bytes(rows.n * width, np.array([len(b) for b in rows.blobs], dtype=np.int64))
