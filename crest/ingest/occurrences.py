"""Finding the occurrences of selected n-grams in a corpus: a chunked scan and a seeded, uniform sample.

For each n-gram: find its occurrences (a chunked scan of the corpus that looks every in-document n-gram up
in a hash table of the selected keys); where there are more than `max_matches`, keep the `max_matches` with
the smallest seeded hash of their position, a uniform sample that depends neither on the chunking nor on the
other n-grams selected (the scan already drops hashes far above the expected cut, and rescans in the rare
case that dropped too many). `crest.ingest.trees` builds the continuation trees from these occurrences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crest.errors import ConfigError
from crest.ingest.ngrams import check_offsets, iter_chunks, run_starts, window_keys

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_HALF = np.uint64(1 << 63)


@dataclass
class Occurrences:
    """Sampled occurrences of K n-grams, grouped by n-gram, positions ascending within a group."""

    ngram: np.ndarray  # [M] int64, index into the n-grams, non-decreasing
    position: np.ndarray  # [M] int64, corpus position of the n-gram's first token
    found: np.ndarray  # [K] int64, in-document occurrences of each n-gram before sampling


def position_hash(positions: np.ndarray, seed: int) -> np.ndarray:
    """Return a seeded 64-bit mix (splitmix64) of each position: the sampling priority."""
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def first_per_group(groups: np.ndarray, limit: int) -> np.ndarray:
    """Return a mask keeping the first `limit` entries of each run of equal values in sorted `groups`."""
    starts = run_starts(groups)
    run_start = np.repeat(starts, np.diff(np.r_[starts, groups.shape[0]]))
    return (np.arange(groups.shape[0]) - run_start) < limit


class _Lookup:
    """A set of distinct n-gram keys answering which n-gram (if any) a key is.

    Packed keys go into an open-addressing hash table (multiplicative hash, linear probing, load <= 1/3)
    probed for all queries at once; void keys of wide n-grams fall back to binary search.
    """

    def __init__(self, grams: np.ndarray, vocab: int) -> None:
        count, n = grams.shape
        self.keys = window_keys(grams.ravel(), np.arange(0, count * n, n), n, vocab)
        order = np.argsort(self.keys, kind="stable")
        if count > 1 and np.any(self.keys[order[1:]] == self.keys[order[:-1]]):
            raise ConfigError("the n-grams to build trees for contain duplicates")
        self.hashed = self.keys.dtype == np.uint64
        if not self.hashed:
            self.order, self.sorted = order, self.keys[order]
            return
        self.bits = max(4, (3 * count).bit_length())
        self.slots = np.full(1 << self.bits, -1, dtype=np.int32 if count < 1 << 31 else np.int64)  # [P] -1 = empty
        self.padded = np.r_[self.keys, np.uint64(0)]  # index -1 reads the pad; its match is masked off
        pending, slot = np.arange(count), self._home(self.keys)
        while pending.shape[0]:
            free = self.slots[slot] < 0
            taken, first = np.unique(slot[free], return_index=True)  # one winner per free slot
            winners = pending[free][first]
            self.slots[taken] = winners
            lost = np.ones(pending.shape[0], dtype=bool)
            lost[np.flatnonzero(free)[first]] = False
            pending, slot = pending[lost], (slot[lost] + 1) & (self.slots.shape[0] - 1)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Return the n-gram index of each key, or -1."""
        if self.keys.shape[0] == 0:
            return np.full(keys.shape[0], -1, dtype=np.int64)
        if not self.hashed:
            at = np.minimum(np.searchsorted(self.sorted, keys), self.sorted.shape[0] - 1)
            return np.where(self.sorted[at] == keys, self.order[at], -1)
        slot = self._home(keys)
        idx = self.slots[slot]
        hit = (self.padded[idx] == keys) & (idx >= 0)
        out = np.where(hit, idx, -1).astype(np.int64)
        probing = np.flatnonzero(~hit & (idx >= 0))  # the home slot holds another key: probe on
        slot = slot[probing]
        while probing.shape[0]:
            slot = (slot + 1) & (self.slots.shape[0] - 1)
            idx = self.slots[slot]
            hit = (self.padded[idx] == keys[probing]) & (idx >= 0)
            out[probing[hit]] = idx[hit]
            more = ~hit & (idx >= 0)
            probing, slot = probing[more], slot[more]
        return out


def _scan(
    tokens: np.ndarray,
    offsets: np.ndarray,
    grams: np.ndarray,
    *,
    vocab: int,
    chunk_tokens: int,
    threshold: np.ndarray | None = None,
    seed: int = 0,
    collect: bool = True,
) -> Occurrences:
    """Find every occurrence of `grams`; keep those whose hash >> 1 is below `threshold` (per n-gram), in order."""
    lookup = _Lookup(grams, vocab)
    count, n = grams.shape
    found = np.zeros(count, dtype=np.int64)
    sels: list[np.ndarray] = []
    poss: list[np.ndarray] = []
    for _, keys, starts in iter_chunks(tokens, offsets, n=n, vocab_size=vocab, chunk_tokens=chunk_tokens):
        sel = lookup.find(keys)
        hit = sel >= 0
        sel, pos = sel[hit], starts[hit]
        found += np.bincount(sel, minlength=count)
        if not collect:
            continue
        if threshold is not None:
            capped = np.flatnonzero(threshold[sel] < _HALF)
            keep = np.ones(sel.shape[0], dtype=bool)
            keep[capped] = (position_hash(pos[capped], seed) >> np.uint64(1)) < threshold[sel[capped]]
            sel, pos = sel[keep], pos[keep]
        sels.append(sel)
        poss.append(pos)
    empty = np.zeros(0, dtype=np.int64)
    return Occurrences(np.concatenate([empty, *sels]), np.concatenate([empty, *poss]), found)


def expected_sample(counts: np.ndarray, max_matches: int) -> np.ndarray:
    """Return how many occurrences of each n-gram the thresholded scan is planned to keep (8 sigma margin)."""
    margin = max_matches + 8.0 * np.sqrt(max_matches) + 16.0
    return np.minimum(counts, int(np.ceil(margin))).astype(np.int64)


def find_occurrences(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    ngrams: np.ndarray,
    *,
    vocab_size: int | None = None,
    counts: np.ndarray | None = None,
    max_matches: int = 5000,
    seed: int = 0,
    chunk_tokens: int = 1 << 22,
) -> Occurrences:
    """Return the in-document occurrences of `ngrams` ([K, n]), a seeded sample of `max_matches` where more."""
    grams = np.asarray(ngrams, dtype=np.int64)
    if grams.ndim != 2 or grams.shape[1] < 1:
        raise ConfigError(f"ngrams must be a [K, n] array with n >= 1, got shape {grams.shape}")
    if max_matches < 1:
        raise ConfigError(f"max_matches must be positive, got {max_matches}")
    offsets, vocab, counts = prepare_scan(tokens, doc_offsets, grams, vocab_size, counts, chunk_tokens)
    # keep an occurrence of a frequent n-gram only when its hash is small enough that about
    # max_matches + 8 sigma survive; the exact bottom-max_matches is taken from the survivors
    planned = expected_sample(counts, max_matches)
    share = planned / np.maximum(counts, 1)
    threshold = np.where(planned < counts, (share * 2.0**63).astype(np.uint64), _HALF)  # [K] keep if hash >> 1 <
    occ = _scan(tokens, offsets, grams, vocab=vocab, chunk_tokens=chunk_tokens, threshold=threshold, seed=seed)
    sel, pos = occ.ngram, occ.position
    kept = np.bincount(sel, minlength=grams.shape[0])
    short = np.flatnonzero(kept < np.minimum(occ.found, max_matches))  # the margin failed (or counts were off)
    if short.shape[0]:
        again = _scan(tokens, offsets, grams[short], vocab=vocab, chunk_tokens=chunk_tokens)
        drop = np.isin(sel, short)
        sel = np.concatenate([sel[~drop], short[again.ngram]])
        pos = np.concatenate([pos[~drop], again.position])
        kept = np.bincount(sel, minlength=grams.shape[0])
    full = kept > max_matches
    if full.any():  # bottom-max_matches by (hash, position) among the n-grams with too many
        over = np.flatnonzero(full[sel])
        order = over[np.lexsort((pos[over], position_hash(pos[over], seed), sel[over]))]
        keep = np.ones(sel.shape[0], dtype=bool)
        keep[order[~first_per_group(sel[order], max_matches)]] = False
        sel, pos = sel[keep], pos[keep]
    return Occurrences(*_sort_pairs(sel, pos), occ.found)


def _sort_pairs(major: np.ndarray, minor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the non-negative pairs sorted by (major, minor): one value sort of packed keys when they fit."""
    if major.shape[0] == 0:
        return major, minor
    low = int(minor.max()).bit_length()
    if int(major.max()).bit_length() + low > 64:
        order = np.lexsort((minor, major))
        return major[order], minor[order]
    key = (major.astype(np.uint64) << np.uint64(low)) | minor.astype(np.uint64)
    key.sort(kind="stable")
    return (key >> np.uint64(low)).astype(np.int64), (key & np.uint64((1 << low) - 1)).astype(np.int64)


def prepare_scan(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    grams: np.ndarray,
    vocab_size: int | None,
    counts: np.ndarray | None,
    chunk_tokens: int,
) -> tuple[np.ndarray, int, np.ndarray]:
    """Return (checked offsets, key vocabulary, occurrences per n-gram), counting them when not given."""
    offsets = check_offsets(doc_offsets, int(tokens.shape[0]))
    vocab = _vocabulary(tokens, grams, vocab_size)
    if counts is None:
        counts = _scan(tokens, offsets, grams, vocab=vocab, chunk_tokens=chunk_tokens, collect=False).found
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)  # [K]
    if counts.shape[0] != grams.shape[0]:
        raise ConfigError(f"counts has {counts.shape[0]} entries for {grams.shape[0]} n-grams")
    return offsets, vocab, counts


def _vocabulary(tokens: np.ndarray, grams: np.ndarray, vocab_size: int | None) -> int:
    """Return the vocabulary size to pack keys with: the given one, else one past the largest id seen."""
    if vocab_size is not None:
        if vocab_size < 1:
            raise ConfigError(f"vocab_size must be positive, got {vocab_size}")
        return int(vocab_size)
    top = int(tokens.max()) if tokens.shape[0] else 0
    return max(top, int(grams.max()) if grams.size else 0) + 1
