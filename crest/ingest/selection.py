"""Keeping n-grams by the tokens their trees are expected to save, not by raw count (`--keep savings|marginal`).

Count-based selection keeps the top-t most common n-grams of each n. Here trees are built for a larger pool (the
`POOL_FACTOR` x top-t most common of each n, or rank blocks until the pool holds `POOL_FACTOR` x the budget in
bytes), each n-gram is scored by occurrences x its tree's expected accepted length, and the best by score are kept
under the same limit: top-t x (number of n) rows, or the budget's bytes. The expected length is the sum of the
nodes' path probabilities taken leave-one-out: in-sample, every continuation seen is in the tree, so any tree that
was not cut to its size would expect the full continuation length (a rare n-gram's thin tree included); a new
occurrence is instead matched only along nodes some other occurrence also passed, so nodes of weight 1 count 0
(sum of the weights >= 2 over the root children's sum). `marginal` scores an n-gram by what it adds over its
(n-1)-suffix (a context drafts from one suffix, so a tree no better than its shorter suffix's saves nothing
extra): occurrences x max(0, expected - the suffix's expected), the suffix's taken from the pool (0 when absent).
Trees and blobs are built once; kept rows are loaded as the count path loads them. Under `--suffix-rule prune` a
budget counts the rows pruning will keep (`crest.ingest.pruned_budget`): the pool grows until its pruned bytes
reach `POOL_FACTOR` x the budget, and the kept rows are the longest prefix of the score order whose rows left by
pruning fit (`choose_pruned`), so the pruned store fills its budget as a count build's does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
from crest_client.choice import promise
from crest_client.codec import TokenTable, decode_tree

from crest.config import KEEP_RULES, IngestOptions
from crest.errors import ConfigError
from crest.ingest.disk import fit_count, rank_blocks
from crest.ingest.ngrams import NgramCounts, Selected, lengths_for, select_top
from crest.ingest.pruned_budget import PrunedBytes

Advance = Callable[[int], None]
Row = tuple[int, bytes, int, bytes, int]  # (index in the selection, key, count, blob, nodes)

POOL_FACTOR = 3  # trees built per tree kept, at most


class Loader(Protocol):
    """What selection needs of the row loader (`crest.ingest.loader.RowLoader`): build, options, table, rows."""

    build: Any
    options: IngestOptions
    table: TokenTable
    width: int

    def frequent(self, selected: dict[int, Selected]) -> dict[int, Selected]: ...

    def fixed_bytes(self) -> int: ...

    def encoded(
        self, tokens: np.ndarray, offsets: np.ndarray, n: int, ngrams: np.ndarray, counts: np.ndarray
    ) -> Iterator[Row]: ...

    def account(self, n: int, rows: Iterable[Row], advance: Advance) -> Iterator[tuple[bytes, int, int, bytes]]: ...


def expected_accepted(blob: bytes, *, n: int, table: TokenTable | None) -> float:
    """Return a tree blob's leave-one-out expected accepted length (nodes one occurrence alone reached count 0)."""
    draft = decode_tree(blob, n=n, table=table)
    weights = draft.weights.astype(np.float64)  # [T], non-increasing along every path
    roots = float(weights[draft.parents < 0].sum())
    return float(weights[weights >= 2].sum()) / roots if roots > 0 else 0.0


def score(counts: np.ndarray, expected: np.ndarray, *, suffix_expected: np.ndarray | None = None) -> np.ndarray:
    """Return expected saved tokens per n-gram: counts x expected (x the gain over the suffix, when given)."""
    gain = expected if suffix_expected is None else np.maximum(expected - suffix_expected, 0.0)
    return counts.astype(np.float64) * gain


def choose(
    scores: np.ndarray, sizes: np.ndarray, *, rows: int | None = None, budget: int | None = None, fixed: int = 0
) -> np.ndarray:
    """Return the indices of the best-scoring rows: the first `rows`, or the longest prefix within `budget` bytes.

    `sizes` are the rows' heap bytes; the budget also pays their hash index and `fixed` (`crest.ingest.disk`).
    """
    order = np.argsort(-scores, kind="stable")  # ties: pool order (count order, shorter n first)
    if rows is not None:
        return order[:rows]
    if budget is None:
        raise ConfigError("choose needs rows or a budget")
    counts = np.arange(1, order.shape[0] + 1, dtype=np.int64)
    return order[: fit_count(np.cumsum(sizes[order]), counts, budget=budget, fixed=fixed)]


def choose_pruned(
    scores: np.ndarray,
    sizes: np.ndarray,
    *,
    keys: list[bytes],
    promises: list[float],
    width: int,
    budget: int,
    fixed: int = 0,
) -> np.ndarray:
    """Return the indices of the best-scoring rows: the longest prefix whose rows left by `prune` fit `budget`."""
    order = np.argsort(-scores, kind="stable")  # as `choose`: each row its own rank, best first
    picked = order.tolist()
    cum, rows = PrunedBytes(width).block(
        0,
        len(picked),
        keys=[keys[i] for i in picked],
        ranks=range(len(picked)),
        promises=[promises[i] for i in picked],
        sizes=sizes[order].tolist(),
    )
    return order[: fit_count(cum, rows, budget=budget, fixed=fixed)]


def load_savings(
    loader: Loader,
    tokens: np.ndarray,
    offsets: np.ndarray,
    counts: NgramCounts,
    rep: Any,
    *,
    row_bytes: Callable[[int, np.ndarray], np.ndarray],
) -> int | None:
    """Build trees for the pool, keep the best by expected saved tokens and load them; return top-t (or None)."""
    opts = loader.options
    if opts.keep not in KEEP_RULES[1:]:
        raise ConfigError(f"load_savings needs --keep savings or marginal, got {opts.keep!r}")
    ns = lengths_for(counts.keys, mode=opts.selection, n=opts.single_n)
    ceiling = max(int(counts.unique(n)) for n in ns)
    pool_t = ceiling if opts.budget is not None else min(ceiling, POOL_FACTOR * (opts.top_t or 1))
    full = loader.frequent(select_top(counts, top_t=pool_t, mode=opts.selection, n=opts.single_n))
    table = loader.table if opts.blob_format == 2 else None
    pool: dict[int, list[Row]] = {n: [] for n in full}
    expected: dict[int, list[float]] = {n: [] for n in full}
    promises: dict[int, list[float]] = {n: [] for n in full}  # `prune` budgets: crest_client.choice.promise
    pruned = PrunedBytes(loader.width) if opts.budget is not None and opts.suffix_rule == "prune" else None
    advance = rep.stage("build trees (pool)", None)
    spent = 0  # the pool's bytes (under `prune`, of its rows pruning keeps)
    for lo, hi in rank_blocks(pool_t):
        if opts.budget is not None and spent >= POOL_FACTOR * opts.budget:
            break
        meta: dict[str, list[Any]] = {"keys": [], "ranks": [], "promises": [], "sizes": []}  # PrunedBytes.block's
        for n, sel in full.items():
            if len(sel.counts) <= lo:
                continue
            for row in loader.encoded(tokens, offsets, n, sel.ngrams[lo:hi], sel.counts[lo:hi]):
                pool[n].append(row)
                expected[n].append(expected_accepted(row[3], n=n, table=table))
                size = int(row_bytes(n, np.array([len(row[3])]))[0])
                if pruned is not None:
                    promises[n].append(promise(n, row[2], row[3], max_matches=opts.max_matches))
                    meta["keys"].append(row[1])
                    meta["ranks"].append(lo + row[0])
                    meta["promises"].append(promises[n][-1])
                    meta["sizes"].append(size)
                spent += size
                advance(1)
        if pruned is not None:
            cum, _ = pruned.block(lo, hi, **meta)
            spent = int(cum[-1]) if len(cum) else spent
    rep.done("build trees (pool)")
    prune_budget, pruned = pruned is not None, None  # its rows and waiting lists are not needed past the pool

    by_key = {n: {row[1]: e for row, e in zip(pool[n], expected[n], strict=True)} for n in pool}
    width = loader.width
    parts_n, parts_i, parts_score, parts_size = [], [], [], []
    keys: list[bytes] = []
    row_promises: list[float] = []
    for n, rows in pool.items():
        if not rows:
            continue
        keys += [r[1] for r in rows]
        row_promises += promises[n]
        exp = np.array(expected[n], dtype=np.float64)  # [R]
        cnt = np.array([r[2] for r in rows], dtype=np.int64)  # [R]
        suffix = None
        if opts.keep == "marginal" and n > 1:
            shorter = by_key.get(n - 1, {})
            suffix = np.array([shorter.get(r[1][width:], 0.0) for r in rows], dtype=np.float64)
        parts_n.append(np.full(len(rows), n, dtype=np.int64))
        parts_i.append(np.arange(len(rows), dtype=np.int64))
        parts_score.append(score(cnt, exp, suffix_expected=suffix))
        parts_size.append(row_bytes(n, np.array([len(r[3]) for r in rows], dtype=np.int64)))
    if not parts_n:
        return opts.top_t
    all_n, all_i = np.concatenate(parts_n), np.concatenate(parts_i)
    limit_rows = None if opts.budget is not None else (opts.top_t or 0) * len(ns)
    scores, sizes = np.concatenate(parts_score), np.concatenate(parts_size)
    if prune_budget and opts.budget is not None:  # fill the budget with the rows pruning keeps
        fixed = loader.fixed_bytes()
        kept = choose_pruned(
            scores, sizes, keys=keys, promises=row_promises, width=width, budget=opts.budget, fixed=fixed
        )
    else:
        kept = choose(scores, sizes, rows=limit_rows, budget=opts.budget, fixed=loader.fixed_bytes())
    advance = rep.stage("load (by expected savings)", int(kept.shape[0]))
    for n, rows in pool.items():
        mine = np.sort(all_i[kept[all_n[kept] == n]])  # count order within n
        loader.build.copy_ngrams(loader.account(n, [rows[int(i)] for i in mine], advance))
    return opts.top_t
