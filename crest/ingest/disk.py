"""What a store version takes on disk, as `crest stores` reports it: the rows, their hash index and fixed parts.

A `--budget` is the bytes `crest stores` reports for the version: its n-gram table (heap, free space and
visibility maps, TOAST), the version's token table and key filter, and the hash index on the keys. The heap grows
with each row (`estimate_row_bytes`); the hash index does not. PostgreSQL sizes its buckets from the table's row
count when the index is built (after `VACUUM (ANALYZE)`, which counts the rows exactly): `rows / 409` rounded up
to a power of two; it splits a bucket (allocating a whole split point) once the rows pass 409 a bucket, and a
bucket whose rows pass a page's 407 spills into overflow pages. So its bytes per row swing between about 20 and
40 with the row count (measured on PostgreSQL 18: 24.4 B at 43,728 rows, 36.0 at 15,000, 25.4 at 100,000 with 52
overflow pages). `hash_index_bytes` follows that rule, with the overflow pages of a Poisson spread of rows over
buckets plus two standard deviations: 0-6% above the measured sizes from 15,000 to 1M rows, more on tiny tables.
Every budget fit (`fit_count`) adds it and the fixed parts to the rows' heap bytes, so a version's reported bytes
stay within its budget (`tests/test_disk.py`), except on tiny stores: the heap is whole pages, so one whose heap
is a page or two may report up to a page (8 kB) more than its budget (rounding the estimate up to whole pages
would leave equal-bytes comparisons of such stores with no row at all).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

PAGE = 8192
HEAP_SLACK = 1.01  # page headers and the end of a page a row does not fit in: measured 0.2% over the rows' sum
FORK_BYTES = 40_960  # free space map (3 pages), visibility map (1) and the empty TOAST table's page: measured
DATA_BYTES = 64  # the token table's and key filter's own headers in crest_store_data
HASH_FFACTOR = (
    409  # PostgreSQL's target rows a bucket at fillfactor 100: 8192 // 20 (8 B header, 8 B code, 4 B pointer)
)
HASH_PAGE_ROWS = 407  # rows a bucket page holds: (8192 - 24 page header - 16 hash special) // 20
FIRST_BLOCK = 4096  # ranks of a budget build's first rank block; each next block is twice the last


def estimate_row_bytes(key_bytes: np.ndarray | int, blob_bytes: np.ndarray | int) -> np.ndarray:
    """Estimate the heap bytes of n-gram rows: tuple, line pointer and their share of the key filter."""
    key = np.asarray(key_bytes, dtype=np.int64)
    blob = np.asarray(blob_bytes, dtype=np.int64)
    blob_hdr = np.where(blob + 1 <= 126, 1, 4)
    data = 4 + (key + 1) + 1 + 2 + 4 + 3 + blob_hdr + blob  # int4, key, pad, int2, int4 (aligned), blob
    heap = (24 + data + 7) // 8 * 8 + 4
    return heap + 2  # + the key filter's 10 bits


def hash_buckets(rows: np.ndarray) -> np.ndarray:
    """Return the buckets a hash index built on tables of `rows` rows starts with: `rows / 409`, truncated, rounded
    up to a power of two, at least 2 (as PostgreSQL 18 builds them here, at every size measured up to 1M rows)."""
    share = np.asarray(rows, dtype=np.float64) / HASH_FFACTOR
    wanted = np.maximum(np.floor(share), 1)
    buckets = np.exp2(np.ceil(np.log2(wanted))).astype(np.int64)
    return np.where(share <= 2.0, 2, buckets)


def _poisson_over(mean: np.ndarray, limit: int) -> np.ndarray:
    """Return P(X > limit) for X ~ Poisson(mean), by the normal approximation (means in the hundreds)."""
    z = (limit + 0.5 - mean) / np.sqrt(np.maximum(mean, 1e-9))
    t = 1.0 / (1.0 + 0.3275911 * np.abs(z) / np.sqrt(2.0))  # erfc by Abramowitz and Stegun 7.1.26
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    tail = 0.5 * poly * np.exp(-(z**2) / 2.0)
    return np.where(z >= 0, tail, 1.0 - tail)


def hash_index_bytes(rows: np.ndarray | int) -> np.ndarray:
    """Return an upper estimate of the hash index's bytes on tables of `rows` rows: meta, bitmap, buckets, overflow.

    The build starts with `hash_buckets` and inserts the rows; once they pass 409 a bucket, the next bucket splits
    off and the pages of its whole split point are allocated (the next power of two under 512 buckets, a quarter
    step past it), while the overflow pages the full buckets filled before stay.
    """
    n = np.asarray(rows, dtype=np.float64)  # exact: VACUUM counted them (crest.db.build.Build.finish_tables)
    start = hash_buckets(n).astype(np.float64)
    split = n > HASH_FFACTOR * start
    pages = np.where(split, np.where(start < 512, 2 * start, start + start // 4), start)
    used = np.maximum(start, np.ceil(n / HASH_FFACTOR))  # buckets holding rows once the splits are done
    spill = _poisson_over(n / used, HASH_PAGE_ROWS) + _poisson_over(n / used, 2 * HASH_PAGE_ROWS)
    before = np.where(split, np.ceil(start * _poisson_over(np.full(n.shape, HASH_FFACTOR), HASH_PAGE_ROWS)), 0)
    expected = used * spill
    overflow = np.ceil(expected + 2 * np.sqrt(expected)) + before  # two standard deviations above the mean
    total = 2 + pages + overflow  # and the meta page and the bitmap page
    return (total * PAGE).astype(np.int64)


def store_bytes(row_bytes: np.ndarray | int, rows: np.ndarray | int, *, fixed: int) -> np.ndarray:
    """Return the bytes a version reports with rows of these summed heap bytes and this count (`fixed`: its own)."""
    heap = np.ceil(np.asarray(row_bytes, dtype=np.float64) * HEAP_SLACK).astype(np.int64)
    return heap + hash_index_bytes(rows) + fixed


def fixed_bytes(token_table_bytes: int) -> int:
    """Return a version's bytes that do not grow with its rows: the table's forks and the version's token table."""
    return FORK_BYTES + DATA_BYTES + int(token_table_bytes)


def fit_count(cum_bytes: np.ndarray, cum_rows: np.ndarray, *, budget: int, fixed: int) -> int:
    """Return how many leading steps fit `budget`: those before the first whose version would report more bytes.

    `cum_bytes[i]` and `cum_rows[i]` are the heap bytes and rows with steps 0..i in (pruning can lower both as
    steps join, so the first step over ends the fit, not the last one under).
    """
    over = np.flatnonzero(store_bytes(cum_bytes, cum_rows, fixed=fixed) > budget)
    return int(over[0]) if len(over) else len(cum_bytes)


def rank_blocks(end: int, *, first: int = FIRST_BLOCK) -> Iterator[tuple[int, int]]:
    """Yield the rank blocks [lo, hi) a budget build loads in turn up to `end`: `first` ranks, then doubling.

    The caller stops once a block's ranks no longer all fit (both engines' loaders) or its pool is full
    (`crest.ingest.selection`); doubling keeps the blocks few on a large budget and the first one cheap on a small.
    """
    lo, size = 0, first
    while lo < end:
        hi = min(end, lo + size)
        yield lo, hi
        lo, size = hi, size * 2
