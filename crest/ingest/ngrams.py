"""Vectorised n-gram counting and CREST's top-t selection.

An n-gram of b-bit token ids is packed into one unsigned 64-bit key (first token in the high bits, so key
order is lexicographic order) when n * b <= 64; otherwise its big-endian 32-bit ids are compared as one
fixed-width void value (byte order is then lexicographic order too, and there are no collisions). The corpus
is scanned in chunks of `chunk_tokens` positions: a chunk's keys come from shifted slices of the chunk, are
counted with a sort, and the sorted chunk tables are merged pairwise like a log-structured merge, so memory
follows the number of distinct n-grams, not the corpus size. An n-gram counts only where it lies inside one
document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from crest.config import SELECTION_MODES
from crest.errors import ConfigError, CorpusError

Advance = Callable[[int], None]


def key_bits(vocab_size: int) -> int:
    """Return the bits needed for one token id."""
    return max(1, int(vocab_size - 1).bit_length())


def packs(n: int, vocab_size: int) -> bool:
    """Return whether an n-gram fits one uint64 key."""
    return n * key_bits(vocab_size) <= 64


def key_dtype(n: int, vocab_size: int) -> np.dtype:
    """Return the dtype of the keys of n-grams over `vocab_size` token ids."""
    return np.dtype(np.uint64) if packs(n, vocab_size) else np.dtype((np.void, 4 * n))


def window_keys(window: np.ndarray, starts: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """Return the keys of the n-grams starting at `starts` (indices into `window`)."""
    return _keys([window[starts + j] for j in range(n)], vocab_size)


def chunk_keys(window: np.ndarray, count: int, n: int, vocab_size: int) -> np.ndarray:
    """Return the keys of the n-grams starting at window positions 0..count-1 (window holds count + n - 1)."""
    return _keys([window[j : j + count] for j in range(n)], vocab_size)


def _keys(columns: list[np.ndarray], vocab_size: int) -> np.ndarray:
    n = len(columns)
    if packs(n, vocab_size):
        bits = np.uint64(key_bits(vocab_size))
        keys = columns[0].astype(np.uint64)
        for col in columns[1:]:
            keys <<= bits
            keys |= col.astype(np.uint64)
        return keys
    rows = np.empty((columns[0].shape[0], n), dtype=">u4")  # [K, n] big-endian: byte order = lexicographic order
    for j, col in enumerate(columns):
        rows[:, j] = col
    return rows.view(key_dtype(n, vocab_size)).ravel()


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


def check_offsets(doc_offsets: np.ndarray, total: int) -> np.ndarray:
    """Return `doc_offsets` as int64, or raise CorpusError unless they split [0, total) into documents."""
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.shape[0] < 1 or offsets[0] != 0 or offsets[-1] != total:
        raise CorpusError(f"document offsets must start at 0 and end at the token count {total}")
    if np.any(offsets[1:] < offsets[:-1]):
        raise CorpusError("document offsets must not decrease")
    return offsets


def doc_ends(doc_offsets: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Return, for each position in [lo, hi), the end of its document."""
    first = int(np.searchsorted(doc_offsets, lo, side="right")) - 1
    last = int(np.searchsorted(doc_offsets, hi, side="left"))
    ends = doc_offsets[first + 1 : last + 1]
    spans = np.minimum(ends, hi) - np.maximum(doc_offsets[first:last], lo)  # positions of each doc in the range
    return np.repeat(ends, np.maximum(spans, 0))


def valid_starts(doc_offsets: np.ndarray, lo: int, hi: int, n: int) -> np.ndarray:
    """Return positions p in [lo, hi) where an n-gram starting at p ends inside p's document."""
    starts = np.arange(lo, hi, dtype=np.int64)
    return starts[starts + n <= doc_ends(doc_offsets, lo, hi)]


def iter_chunks(
    tokens: np.ndarray, doc_offsets: np.ndarray, *, n: int, vocab_size: int, chunk_tokens: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield (positions scanned, keys, start positions) of the in-document n-grams, chunk by chunk."""
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    total = int(tokens.shape[0])
    for lo in range(0, total, chunk_tokens):
        hi = min(total, lo + chunk_tokens)
        window = np.asarray(tokens[lo : min(total, hi + n - 1)])
        if window.shape[0] and (int(window.min()) < 0 or int(window.max()) >= vocab_size):
            bad = int(window.min()) if int(window.min()) < 0 else int(window.max())
            raise CorpusError(f"token id {bad} lies outside the vocabulary of size {vocab_size}")
        if window.shape[0] < hi - lo + n - 1:  # the corpus end: pad; no valid n-gram reads the padding
            window = np.concatenate([window, np.zeros(hi - lo + n - 1 - window.shape[0], dtype=window.dtype)])
        starts = np.arange(lo, hi, dtype=np.int64)
        valid = starts + n <= doc_ends(doc_offsets, lo, hi)  # [hi - lo]
        yield hi - lo, chunk_keys(window, hi - lo, n, vocab_size)[valid], starts[valid]


def run_starts(values: np.ndarray) -> np.ndarray:
    """Return the indices where a run of equal values starts in `values`."""
    if values.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, values[1:] != values[:-1]])


def _count_sorted(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the distinct keys and their counts of a key array, sorting it in place."""
    keys.sort()
    first = run_starts(keys)
    return keys[first], np.diff(np.r_[first, keys.shape[0]]).astype(np.int64)


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Merge two sorted (keys, counts) tables of distinct keys, adding the counts of shared keys."""
    if a[0].shape[0] < b[0].shape[0]:
        a, b = b, a
    (keys, counts), (extra, extra_counts) = a, b
    at = np.searchsorted(keys, extra)  # [E] where each key of the smaller table goes
    shared = np.zeros(extra.shape[0], dtype=bool)
    inside = np.flatnonzero(at < keys.shape[0])
    shared[inside] = keys[at[inside]] == extra[inside]
    counts[at[shared]] += extra_counts[shared]  # tables are owned here: update in place
    fresh = ~shared
    dest = at[fresh] + np.arange(int(fresh.sum()))  # [F] position of each new key in the merged table
    inserted = np.zeros(keys.shape[0] + dest.shape[0], dtype=bool)
    inserted[dest] = True
    merged_keys = np.empty(inserted.shape[0], dtype=keys.dtype)
    merged_keys[dest], merged_keys[~inserted] = extra[fresh], keys
    merged_counts = np.empty(inserted.shape[0], dtype=np.int64)
    merged_counts[dest], merged_counts[~inserted] = extra_counts[fresh], counts
    return merged_keys, merged_counts


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
        """Return token ids [K, n] int32 of the distinct n-grams (or of those at `index`)."""
        keys = self.keys[n] if index is None else self.keys[n][index]
        return unpack_keys(keys, n, self.vocab_size)


def count_ngrams(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    *,
    max_n: int = 4,
    vocab_size: int,
    chunk_tokens: int = 1 << 22,
    progress: Advance | None = None,
) -> NgramCounts:
    """Count every n-gram (n = 1..max_n) that lies inside one document."""
    if max_n < 1:
        raise ConfigError(f"max_n must be at least 1, got {max_n}")
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be positive, got {vocab_size}")
    offsets = check_offsets(doc_offsets, int(tokens.shape[0]))
    result = NgramCounts(vocab_size=vocab_size)
    for n in range(1, max_n + 1):
        parts: list[tuple[np.ndarray, np.ndarray]] = []  # sorted tables, sizes roughly halving: an LSM stack
        positions = 0
        for scanned, keys, _ in iter_chunks(tokens, offsets, n=n, vocab_size=vocab_size, chunk_tokens=chunk_tokens):
            positions += int(keys.shape[0])
            parts.append(_count_sorted(keys))
            while len(parts) > 1 and parts[-2][0].shape[0] <= 2 * parts[-1][0].shape[0]:
                top = parts.pop()
                parts.append(_merge(parts.pop(), top))
            if progress is not None:
                progress(scanned)
        while len(parts) > 1:
            top = parts.pop()
            parts.append(_merge(parts.pop(), top))
        if parts:
            result.keys[n], result.counts[n] = parts[0]
        else:
            result.keys[n], result.counts[n] = np.zeros(0, key_dtype(n, vocab_size)), np.zeros(0, np.int64)
        result.totals[n] = positions
    return result


@dataclass
class Selected:
    """The kept n-grams of one n, most common first (ties: smaller token ids first)."""

    ngrams: np.ndarray  # [k, n] int32
    counts: np.ndarray  # [k] int64
    keys: np.ndarray  # [k] packed keys


def kth_largest(values: np.ndarray, k: int) -> int:
    """Return the k-th largest of non-negative integers (1 <= k <= size), by histogram for small values."""
    cap = 1 << 16
    high = values[values >= cap]
    if high.shape[0] >= k:
        return int(np.partition(high, high.shape[0] - k)[high.shape[0] - k])
    at_least = np.cumsum(np.bincount(np.minimum(values, cap), minlength=cap + 1)[::-1])[::-1]  # [cap + 1]
    return int(np.flatnonzero(at_least >= k)[-1])


def rank(counts: NgramCounts, n: int, top_t: int | None = None) -> np.ndarray:
    """Return the indices of the `top_t` (default all) most common n-grams of length n, ties by token ids."""
    values = counts.counts.get(n, np.zeros(0, dtype=np.int64))
    if top_t is not None and top_t < values.shape[0]:
        cut = kth_largest(values, top_t)
        above = np.flatnonzero(values > cut)
        index = np.union1d(above, np.flatnonzero(values == cut)[: top_t - above.shape[0]])
    else:
        index = np.arange(values.shape[0])
    # keys are sorted ascending, so a stable sort on -count keeps lexicographic order within ties
    return index[np.argsort(-values[index], kind="stable")]


def lengths_for(counted: Iterable[int], *, mode: str = "combined", n: int | None = None) -> list[int]:
    """Return the n-gram lengths a selection mode keeps of the `counted` ones (every n, one n, or each n <= m)."""
    counted = sorted(counted)
    if mode == "combined":
        return counted
    if mode == "single":
        if n is None or n not in counted:
            raise ConfigError(f"selection 'single' needs an n among the counted lengths {counted}, got {n}")
        return [n]
    if mode == "upto":
        if n is not None and n < 1:
            raise ConfigError(f"selection 'upto' needs n >= 1, got {n}")
        return [k for k in counted if n is None or k <= n]
    raise ConfigError(f"unknown selection mode {mode!r}: use one of {', '.join(SELECTION_MODES)}")


def select_top(counts: NgramCounts, *, top_t: int, mode: str = "combined", n: int | None = None) -> dict[int, Selected]:
    """Keep the `top_t` most common n-grams of each n (combined), of one n (single) or of each n <= m (upto)."""
    if top_t <= 0:
        raise ConfigError(f"top_t must be a positive number of n-grams, got {top_t}")
    out: dict[int, Selected] = {}
    for k in lengths_for(counts.keys, mode=mode, n=n):
        order = rank(counts, k, top_t)
        out[k] = Selected(counts.ngrams(k, order), counts.counts[k][order], counts.keys[k][order])
    return out
