"""Vectorised n-gram counting and CREST's top-t selection.

An n-gram of b-bit token ids is packed into one unsigned 64-bit key (first token in the high bits, so
key order is lexicographic order) when n * b <= 64; otherwise its big-endian bytes are compared as a
fixed-width void value. The corpus is scanned in chunks of `chunk_tokens` positions: each chunk's keys
are counted with `np.unique` and merged into the running table, so memory follows the number of distinct
n-grams, not the corpus size. An n-gram counts only where it lies inside one document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Advance = Callable[[int], None]


def key_bits(vocab_size: int) -> int:
    """Return the bits needed for one token id."""
    return max(1, int(vocab_size - 1).bit_length())


def packs(n: int, vocab_size: int) -> bool:
    """Return whether an n-gram fits one uint64 key."""
    return n * key_bits(vocab_size) <= 64


def window_keys(window: np.ndarray, starts: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """Return the keys of the n-grams starting at `starts` (indices into `window`)."""
    if packs(n, vocab_size):
        bits = np.uint64(key_bits(vocab_size))
        keys = window[starts].astype(np.uint64)
        for j in range(1, n):
            keys = (keys << bits) | window[starts + j].astype(np.uint64)
        return keys
    rows = np.empty((starts.shape[0], n), dtype=">u4")  # [K, n] big-endian: byte order = lexicographic order
    for j in range(n):
        rows[:, j] = window[starts + j]
    return rows.view(np.dtype((np.void, 4 * n))).ravel()


def unpack_keys(keys: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """Return the token ids [K, n] int32 of packed keys."""
    if packs(n, vocab_size):
        bits = key_bits(vocab_size)
        mask = np.uint64((1 << bits) - 1)
        out = np.empty((keys.shape[0], n), dtype=np.int32)
        for j in range(n):
            out[:, j] = ((keys >> np.uint64(bits * (n - 1 - j))) & mask).astype(np.int32)
        return out
    return np.frombuffer(keys.tobytes(), dtype=">u4").reshape(-1, n).astype(np.int32)


def valid_starts(doc_offsets: np.ndarray, lo: int, hi: int, n: int) -> np.ndarray:
    """Return positions p in [lo, hi) where an n-gram starting at p ends inside p's document."""
    first = int(np.searchsorted(doc_offsets, lo, side="right")) - 1
    last = int(np.searchsorted(doc_offsets, hi, side="left"))
    bounds = doc_offsets[first : last + 1]
    starts = np.arange(lo, hi, dtype=np.int64)
    doc_end = bounds[np.searchsorted(bounds, starts, side="right")]  # [hi - lo] end of each position's document
    return starts[starts + n <= doc_end]


def _merge(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse.ravel(), weights=counts, minlength=len(uniq)).astype(np.int64)


@dataclass
class NgramCounts:
    """Distinct n-grams (sorted keys) with their counts, per n, and the number of positions counted."""

    vocab_size: int
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    totals: dict[int, int] = field(default_factory=dict)

    def unique(self, n: int) -> int:
        """Return how many distinct n-grams of length n the corpus has."""
        return int(self.keys[n].shape[0]) if n in self.keys else 0

    def positions(self, n: int) -> int:
        """Return how many n-gram occurrences of length n the corpus has."""
        return int(self.totals.get(n, 0))

    def ngrams(self, n: int, index: np.ndarray | None = None) -> np.ndarray:
        """Return token ids [K, n] of the distinct n-grams (or of those at `index`)."""
        keys = self.keys[n] if index is None else self.keys[n][index]
        return unpack_keys(keys, n, self.vocab_size)


def count_ngrams(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    *,
    max_n: int = 4,
    vocab_size: int,
    chunk_tokens: int = 1 << 23,
    progress: Advance | None = None,
) -> NgramCounts:
    """Count every n-gram (n = 1..max_n) that lies inside one document."""
    result = NgramCounts(vocab_size=vocab_size)
    total = int(tokens.shape[0])
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    for n in range(1, max_n + 1):
        parts_k: list[np.ndarray] = []
        parts_c: list[np.ndarray] = []
        pending = 0
        positions = 0
        for lo in range(0, total, chunk_tokens):
            hi = min(total, lo + chunk_tokens)
            window = np.asarray(tokens[lo : min(total, hi + n - 1)])
            starts = valid_starts(offsets, lo, hi, n)
            positions += int(starts.shape[0])
            if starts.shape[0]:
                keys, counts = np.unique(window_keys(window, starts - lo, n, vocab_size), return_counts=True)
                parts_k.append(keys)
                parts_c.append(counts.astype(np.int64))
                pending += keys.shape[0]
            if pending > 4 * chunk_tokens and len(parts_k) > 1:  # keep the running table compact
                merged = _merge(np.concatenate(parts_k), np.concatenate(parts_c))
                parts_k, parts_c, pending = [merged[0]], [merged[1]], merged[0].shape[0]
            if progress is not None:
                progress(hi - lo)
        if len(parts_k) == 1:
            keys, counts = parts_k[0], parts_c[0]
        elif parts_k:
            keys, counts = _merge(np.concatenate(parts_k), np.concatenate(parts_c))
        else:
            keys = np.zeros(0, dtype=np.uint64 if packs(n, vocab_size) else np.dtype((np.void, 4 * n)))
            counts = np.zeros(0, dtype=np.int64)
        result.keys[n], result.counts[n], result.totals[n] = keys, counts, positions
    return result


@dataclass
class Selected:
    """The kept n-grams of one n, most common first (ties: smaller token ids first)."""

    ngrams: np.ndarray  # [k, n] int32
    counts: np.ndarray  # [k] int64
    keys: np.ndarray  # [k] packed keys


def rank(counts: NgramCounts, n: int) -> np.ndarray:
    """Return the indices of the n-grams of length n, most common first, ties by token ids."""
    if counts.unique(n) == 0:
        return np.zeros(0, dtype=np.int64)
    # keys are sorted ascending, so a stable sort on -count keeps lexicographic order within ties
    return np.argsort(-counts.counts[n], kind="stable")


def select_top(counts: NgramCounts, *, top_t: int, mode: str = "combined", n: int | None = None) -> dict[int, Selected]:
    """Keep the `top_t` most common n-grams of each n (combined), of one n (single) or of each n <= m (upto)."""
    if top_t <= 0:
        raise ValueError("top_t must be positive")
    if mode == "combined":
        lengths = sorted(counts.keys)
    elif mode == "single":
        lengths = [int(n or 1)]
    elif mode == "upto":
        lengths = [k for k in sorted(counts.keys) if k <= int(n or max(counts.keys))]
    else:
        raise ValueError(f"unknown selection mode {mode!r}")
    out: dict[int, Selected] = {}
    for k in lengths:
        order = rank(counts, k)[:top_t]
        out[k] = Selected(counts.ngrams(k, order), counts.counts[k][order], counts.keys[k][order])
    return out
