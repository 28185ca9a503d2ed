"""A `--budget` build under `--suffix-rule prune` is filled with the rows pruning keeps, not the rows it loads.

`PrunedBytes` is checked against pruning restated from scratch at every rank (the rows ranked below it, each kept
when no stored proper suffix outranks it, `kept_by_prune`), whatever the block schedule; a real budget build
against the fixed top-t build of the T it reached (same rows, its reported bytes within the budget) and of T + 1
(over it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psycopg
import pytest

from crest.config import IngestOptions
from crest.ingest.disk import estimate_row_bytes, fixed_bytes, store_bytes
from crest.ingest.pipeline import ingest
from crest.ingest.pruned_budget import PrunedBytes
from crest.ingest.suffixes import kept_by_prune, prune_mask
from tests.fix_corpus import copy_stdlib_sample

WIDTH = 2  # bytes a token in the synthetic keys
BUDGET = 700_000  # bytes on disk: ends in the second rank block when pruned, the first when not
Row = tuple[bytes, int, bytes]  # key, count, tree
REPORTED: dict[str, int] = {}  # the bytes each store built here reports (table and index)
ESTIMATED: dict[str, int] = {}  # what a budget fit estimates for its rows (crest.ingest.disk.store_bytes)


def _rows(seed: int, per_n: int) -> list[tuple[bytes, int, int, float, int]]:
    """Return synthetic (key, n, rank, promise, size) rows: n = 1..4 over 6 tokens, ranked per n, tied promises."""
    rng = np.random.default_rng(seed)
    out = []
    for n in range(1, 5):
        grams = {tuple(int(t) for t in rng.integers(0, 6, size=n)) for _ in range(4 * per_n)}
        chosen = list(grams)[:per_n]
        order = rng.permutation(len(chosen))
        for rank, i in enumerate(order.tolist()):
            key = b"".join(t.to_bytes(WIDTH, "big") for t in chosen[i])
            out.append((key, n, rank, float(rng.integers(0, 8)) / 8, int(rng.integers(20, 200))))
    return out


def _pruned_bytes(rows: list[tuple[bytes, int, int, float, int]], below: int) -> tuple[int, int]:
    """Return the bytes and rows pruning keeps among the rows ranked below `below`, restated from its rule."""
    present = {key: (p, n) for key, n, rank, p, _ in rows if rank < below}
    total = kept = 0
    for key, n, rank, p, size in rows:
        if rank >= below:
            continue
        suffixes = [present[key[c:]] for c in range(WIDTH, len(key), WIDTH) if key[c:] in present]
        if kept_by_prune((p, n), max(suffixes) if suffixes else None):
            total, kept = total + size, kept + 1
    return total, kept


@pytest.mark.parametrize(
    ("seed", "blocks"),
    [(0, [5, 10, 20, 40]), (1, [1] * 30), (2, [40]), (3, [3, 7, 11, 19])],
    ids=["doubling", "one-rank-blocks", "one-block", "uneven"],
)
def test_kept_bytes_at_every_rank_equal_pruning_restated(seed: int, blocks: list[int]) -> None:
    rows = _rows(seed, per_n=sum(blocks))
    pruned, lo = PrunedBytes(WIDTH), 0
    for size in blocks:
        hi = lo + size
        part = [r for r in rows if lo <= r[2] < hi]
        rng = np.random.default_rng(seed + hi)
        part = [part[i] for i in rng.permutation(len(part))]  # the order rows arrive in must not matter
        cum, count = pruned.block(
            lo,
            hi,
            keys=[r[0] for r in part],
            ranks=[r[2] for r in part],
            promises=[r[3] for r in part],
            sizes=[r[4] for r in part],
        )
        want = [_pruned_bytes(rows, r + 1) for r in range(lo, hi)]
        assert list(zip(cum.tolist(), count.tolist(), strict=True)) == want, f"block [{lo}, {hi})"
        lo = hi
    unpruned = sum(r[4] for r in rows if r[2] < lo)
    assert 0 < pruned.spent < unpruned, "the synthetic rows must lose some rows to pruning"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """About 100 KB of Python's standard library: thousands of n-grams of each n, of varied promise."""
    return copy_stdlib_sample(tmp_path_factory.mktemp("stdlib"))


def _build(dsn: str, corpus: str, tokenizer: Path, store: str, **options: object) -> tuple[int | None, list[Row]]:
    """Build a store; return its T and its rows (key, count, tree); record its reported bytes in `REPORTED`."""
    opts = IngestOptions(max_matches=30, tree_size=16, **options)  # type: ignore[arg-type]
    summary = ingest([corpus], store=store, tokenizer=str(tokenizer), dsn=dsn, options=opts)
    REPORTED[store] = summary.table_bytes + summary.index_bytes
    with psycopg.connect(dsn) as conn:
        found = conn.execute(f"SELECT key, count, tree FROM crest_ngrams_s{int(summary.store_id)} ORDER BY key")
        rows = [(bytes(k), int(c), bytes(t)) for k, c, t in found.fetchall()]
        table = conn.execute("SELECT token_table FROM crest_store_data WHERE store_id = %s", (summary.store_id,))
        fixed = fixed_bytes(len(bytes(table.fetchone()[0])))  # type: ignore[index]
    ESTIMATED[store] = int(store_bytes(_heap(rows), len(rows), fixed=fixed))
    return summary.top_t, rows


def _heap(rows: list[Row]) -> int:
    return int(sum(estimate_row_bytes(len(k), np.array([len(t)]))[0] for k, _, t in rows))


def test_a_pruned_budget_build_is_the_largest_pruned_top_t_within_the_budget(
    db_dsn: str, corpus: str, smollm2_gguf: Path
) -> None:
    budget = BUDGET
    unpruned_t, _ = _build(db_dsn, corpus, smollm2_gguf, "every", budget=budget, suffix_rule="lookup")
    reached, rows = _build(db_dsn, corpus, smollm2_gguf, "budget", budget=budget, suffix_rule="prune")
    assert reached is not None and unpruned_t is not None
    assert 4096 < reached < 8192 and reached > 2 * unpruned_t, "the budget must end in the second rank block"
    assert 0.9 * budget < REPORTED["budget"] <= ESTIMATED["budget"] <= budget  # what `crest stores` says fits
    assert _build(db_dsn, corpus, smollm2_gguf, "fixed", top_t=reached, suffix_rule="prune")[1] == rows
    _build(db_dsn, corpus, smollm2_gguf, "next", top_t=reached + 1, suffix_rule="prune")
    assert ESTIMATED["next"] > budget


@pytest.mark.parametrize("keep", ["savings", "marginal"], ids=["savings", "marginal"])
def test_a_pruned_savings_budget_fills_the_budget_with_the_rows_pruning_keeps(
    db_dsn: str, corpus: str, smollm2_gguf: Path, keep: str
) -> None:
    budget = BUDGET
    _, every = _build(db_dsn, corpus, smollm2_gguf, "lookup", budget=budget, keep=keep, suffix_rule="lookup")
    _, rows = _build(db_dsn, corpus, smollm2_gguf, "pruned", budget=budget, keep=keep, suffix_rule="prune")
    assert 0.85 * budget < REPORTED["pruned"] <= ESTIMATED["pruned"] <= budget
    # what counting the rows before pruning left: the same choice's unpruned store, pruned
    width = 2  # SmolLM2's 49,152 ids
    ordered = sorted(((k, len(k) // width, c, t) for k, c, t in every), key=lambda r: r[1])
    mask = prune_mask(ordered, width=width, max_matches=30)
    left = [(k, c, t) for (k, _, c, t), kept in zip(ordered, mask, strict=True) if kept]
    assert _heap(left) < 0.75 * _heap([(k, c, t) for k, c, t in rows])  # savings 36%, marginal 54% of it here
