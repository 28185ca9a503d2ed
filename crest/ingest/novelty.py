"""Which positions of a judged text are novel: the windows around them occur nowhere in a store's documents.

`--suffix-rule auto` judges its two rules only where the text is not a verbatim repeat of the corpus
(`crest.ingest.suffix_choice`): at a repeat the longest suffix's thin tree holds exactly what follows, which
flatters `longest`. A position p is novel when the `2 * window` tokens [p - window, p + window) lie in its document
and occur in no build document. Windows are compared by a 64-bit polynomial hash; the build is read in chunks, so
memory stays bounded by the chunk and the judged text. Spark builds mark the windows partition by partition with
the same functions (`crest.ingest.spark_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POSITIONS = 4000  # judged positions the rules are compared at, at most
_PRIME = np.uint64(1099511628211)  # of the polynomial window hash (FNV's 64-bit prime)


def novel_positions(
    build: tuple[np.ndarray, np.ndarray],
    held: tuple[np.ndarray, np.ndarray],
    *,
    window: int,
    chunk_tokens: int = 1 << 22,
) -> np.ndarray:
    """Return [H] bools: the held-out positions p whose tokens [p - window, p + window) lie in p's document and
    occur in no build document.

    Windows are compared by a 64-bit polynomial hash; the build is read in chunks of `chunk_tokens` windows, so
    memory stays bounded by the chunk and the held-out slice, not the corpus.
    """
    # build, held: (tokens [N] int32, offsets [D + 1] int64)
    windows = JudgedWindows.of(held, window=window)
    return windows.novel(seen_windows(*build, windows.wanted, size=2 * window, chunk_tokens=chunk_tokens))


@dataclass
class JudgedWindows:
    """The windows around a judged text's positions: where each starts, and their distinct hashes."""

    positions: int  # H, the judged text's tokens
    window: int
    starts: np.ndarray  # [W] int64 starts of the windows inside one document
    wanted: np.ndarray  # [U] uint64 distinct window hashes, sorted
    first: np.ndarray  # [W] index into `wanted` of each window's hash

    @classmethod
    def of(cls, held: tuple[np.ndarray, np.ndarray], *, window: int) -> JudgedWindows:
        """Return the windows of `2 * window` tokens of the judged text (tokens, offsets)."""
        tokens, offsets = held
        size = 2 * window
        starts = _window_starts(offsets, 0, max(tokens.shape[0] - size + 1, 0), size)  # [W] inside a document
        hashes = _window_hashes(tokens, starts, size)
        wanted, first = np.unique(hashes, return_inverse=True)
        return cls(int(tokens.shape[0]), window, starts, wanted, first.reshape(-1))

    def novel(self, seen: np.ndarray) -> np.ndarray:
        """Return [H] bools: the positions whose window is not `seen` ([U] bools over `wanted`)."""
        found = np.zeros(self.positions, dtype=bool)
        if self.starts.shape[0]:
            found[self.starts + self.window] = ~seen[self.first]
        return found


def seen_windows(
    tokens: np.ndarray, offsets: np.ndarray, wanted: np.ndarray, *, size: int, chunk_tokens: int = 1 << 22
) -> np.ndarray:
    """Return [U] bools: which of the `wanted` window hashes (sorted) occur in these documents' windows of `size`.

    The documents are read in chunks of `chunk_tokens` windows, so memory stays bounded by the chunk.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    seen = np.zeros(wanted.shape[0], dtype=bool)
    if not wanted.shape[0]:
        return seen
    total = max(int(tokens.shape[0]) - size + 1, 0)
    for lo in range(0, total, chunk_tokens):
        at = _window_starts(offsets, lo, min(lo + chunk_tokens, total), size)
        got = _window_hashes(tokens, at, size)
        where = np.minimum(np.searchsorted(wanted, got), wanted.shape[0] - 1)
        seen[where[wanted[where] == got]] = True
    return seen


def _window_starts(offsets: np.ndarray, lo: int, hi: int, size: int) -> np.ndarray:
    """Return the starts q in [lo, hi) whose `size` tokens lie inside one document."""
    q = np.arange(lo, hi, dtype=np.int64)
    doc = np.searchsorted(offsets, q, side="right") - 1  # [Q] the document each window starts in
    return q[q + size <= offsets[np.minimum(doc + 1, offsets.shape[0] - 1)]]


def _window_hashes(tokens: np.ndarray, starts: np.ndarray, size: int) -> np.ndarray:
    """Return the 64-bit hash of tokens[q : q + size] for each start q (uint64 arithmetic wraps)."""
    h = np.zeros(starts.shape[0], dtype=np.uint64)
    for k in range(size):
        h = h * _PRIME + tokens[starts + k].astype(np.uint64) + np.uint64(1)
    return h


def judged_positions(
    offsets: np.ndarray, novel: np.ndarray | None, *, seed: int
) -> tuple[list[tuple[int, int, int]], bool]:
    """Return up to `POSITIONS` seeded (its document's start, position, its document's end) with a token before and
    one after, novel ones only when `novel` marks any, and whether they are."""
    at = np.arange(int(offsets[-1]) if offsets.shape[0] else 0, dtype=np.int64)
    doc = np.searchsorted(offsets, at, side="right") - 1  # [H] the document of each held-out token
    usable = at > offsets[doc]  # p with start < p < end
    judged_novel = novel is not None and bool(np.count_nonzero(novel & usable))
    if judged_novel:
        assert novel is not None
        usable &= novel
    candidates = at[usable]
    if candidates.shape[0] == 0:
        return [], False
    count = candidates.shape[0]
    p = candidates[np.sort(np.random.default_rng(seed).choice(count, size=min(POSITIONS, count), replace=False))]
    spans = offsets[doc[p]].tolist(), p.tolist(), offsets[doc[p] + 1].tolist()
    return list(zip(*spans, strict=True)), judged_novel
