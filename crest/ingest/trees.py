"""Bulk, vectorised construction of the continuation trees of the selected n-grams.

For each n-gram: find its occurrences (a chunked scan of the corpus that looks every in-document n-gram up
in a hash table of the selected keys); where there are more than `max_matches`, keep the `max_matches` with
the smallest seeded hash of their position, a uniform sample that depends neither on the chunking nor on the
other n-grams selected (the scan already drops hashes far above the expected cut, and rescans in the rare
case that dropped too many). Take the `continuation_length` tokens after each kept occurrence (clipped at the
document end) and build the trie level by level: the nodes of depth d are the distinct (parent, token) pairs
of the continuations still alive, found by one integer sort, and a node's weight is the number of
continuations through it. A continuation stops once its node weighs no more than a lower bound of its tree's
`tree_size`-th heaviest weight: every deeper node would rank after all nodes made so far, so pruning is
exact. The `tree_size` nodes kept are the first in the canonical order every drafter uses
(`crest_client.order`: weight desc, depth asc, token asc, parent's position asc), so weights never increase
and every prefix is the heaviest subtree of its size; they are stored in that order refined by `chain_order`
(equal-weight chains made contiguous), which keeps those properties and lets the codec store most parents
in one bit. Selected n-grams are processed in groups (one scan each) and the tries in batches, so memory
follows `scan_occurrences` and `batch_occurrences`, not the corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from crest_client.draft import Draft
from crest_client.order import best_first, chain_order, lex_order, rank_level

from crest.errors import ConfigError
from crest.ingest.ngrams import check_offsets, iter_chunks, run_starts, window_keys

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_HALF = np.uint64(1 << 63)


@dataclass
class TreeBatch:
    """Trees of several n-grams in CSR form; tree j holds nodes offsets[j]:offsets[j + 1]."""

    ngram_index: np.ndarray  # [B] int64, index into the `ngrams` given to build_trees
    offsets: np.ndarray  # [B + 1] int64
    tokens: np.ndarray  # [N] int32
    parents: np.ndarray  # [N] int32, -1 = child of the root, else index within the same tree
    weights: np.ndarray  # [N] int64, continuations through the node, non-increasing within a tree
    occurrences: np.ndarray  # [B] int64, in-document occurrences of the n-gram: the corpus positions it covers
    matches: np.ndarray  # [B] int64, occurrences whose continuations built the tree (after sampling)

    def __len__(self) -> int:
        return int(self.ngram_index.shape[0])

    def draft(self, j: int, n: int = 0) -> Draft:
        """Return tree j as a Draft matched on an n-token context suffix."""
        lo, hi = int(self.offsets[j]), int(self.offsets[j + 1])
        return Draft(self.tokens[lo:hi].astype(np.int64), self.parents[lo:hi].copy(), self.weights[lo:hi].copy(), n)


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


def _first_per_group(groups: np.ndarray, limit: int) -> np.ndarray:
    """Return a mask keeping the first `limit` entries of each run of equal values in sorted `groups`."""
    starts = run_starts(groups)
    run_start = np.repeat(starts, np.diff(np.r_[starts, groups.shape[0]]))
    return (np.arange(groups.shape[0]) - run_start) < limit


def _ranges(sizes: np.ndarray, limit: int, max_items: int | None = None) -> Iterator[tuple[int, int]]:
    """Yield consecutive index ranges whose sizes sum to at most `limit` (or hold one item), of <= max_items."""
    ends = np.cumsum(sizes)
    lo, total = 0, int(sizes.shape[0])
    while lo < total:
        before = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, before + limit, side="right")))
        hi = min(hi, total, lo + max_items) if max_items else min(hi, total)
        yield lo, hi
        lo = hi


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


def _expected_sample(counts: np.ndarray, max_matches: int) -> np.ndarray:
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
    offsets, vocab, counts = _prepare(tokens, doc_offsets, grams, vocab_size, counts, chunk_tokens)
    # keep an occurrence of a frequent n-gram only when its hash is small enough that about
    # max_matches + 8 sigma survive; the exact bottom-max_matches is taken from the survivors
    planned = _expected_sample(counts, max_matches)
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
        keep[order[~_first_per_group(sel[order], max_matches)]] = False
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


def _prepare(
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


def build_trees(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    ngrams: np.ndarray,
    *,
    n: int,
    vocab_size: int | None = None,
    counts: np.ndarray | None = None,
    continuation_length: int = 10,
    max_matches: int = 5000,
    tree_size: int = 64,
    seed: int = 0,
    batch_size: int = 1 << 16,
    batch_occurrences: int = 1 << 20,
    scan_occurrences: int = 1 << 24,
    chunk_tokens: int = 1 << 22,
) -> Iterator[TreeBatch]:
    """Yield the continuation trees of `ngrams` ([K, n] int32) in batches of <= batch_size, in order.

    `counts` (occurrences of each n-gram, as counted by `count_ngrams`) saves one scan of the corpus; a
    scan gathers the occurrences of n-grams planned to keep at most `scan_occurrences`, and a trie batch
    holds at most `batch_occurrences` continuations (or one n-gram).
    """
    for label, value in (
        ("n", n),
        ("continuation_length", continuation_length),
        ("max_matches", max_matches),
        ("tree_size", tree_size),
        ("batch_size", batch_size),
        ("batch_occurrences", batch_occurrences),
        ("scan_occurrences", scan_occurrences),
        ("chunk_tokens", chunk_tokens),
    ):
        if value < 1:
            raise ConfigError(f"{label} must be positive, got {value}")
    grams = np.asarray(ngrams, dtype=np.int64).reshape(-1, n)
    offsets, vocab, counts = _prepare(tokens, doc_offsets, grams, vocab_size, counts, chunk_tokens)
    planned = _expected_sample(counts, max_matches)
    for g0, g1 in _ranges(planned, scan_occurrences):
        occ = find_occurrences(
            tokens,
            offsets,
            grams[g0:g1],
            vocab_size=vocab,
            counts=counts[g0:g1],
            max_matches=max_matches,
            seed=seed,
            chunk_tokens=chunk_tokens,
        )
        bounds = np.searchsorted(occ.ngram, np.arange(g1 - g0 + 1))  # occurrences of n-gram i: bounds[i]:[i+1]
        for b0, b1 in _ranges(np.diff(bounds), batch_occurrences, batch_size):
            a, b = int(bounds[b0]), int(bounds[b1])
            yield trie_batch(
                tokens,
                offsets,
                np.arange(g0 + b0, g0 + b1, dtype=np.int64),
                occ.found[b0:b1],
                occ.ngram[a:b] - b0,
                occ.position[a:b] + n,
                length=continuation_length,
                size=tree_size,
            )


def _weight_grid(max_weight: int) -> np.ndarray:
    """Return ascending weight levels for pruning histograms: every weight up to 32, then ratio 1.125."""
    steps = int(np.ceil(np.log(max(2, max_weight) / 32) / np.log(1.125))) + 1 if max_weight > 32 else 0
    return np.unique(np.r_[np.arange(1, 33), np.floor(32 * 1.125 ** np.arange(steps + 1))].astype(np.int64))


def trie_batch(
    tokens: np.ndarray,
    offsets: np.ndarray,
    index: np.ndarray,
    occurrences: np.ndarray,
    tree: np.ndarray,
    start: np.ndarray,
    *,
    length: int,
    size: int,
) -> TreeBatch:
    """Build and prune the tries of one batch; `tree[i]` owns the continuation starting at `start[i]`."""
    trees = index.shape[0]
    matches = np.bincount(tree, minlength=trees).astype(np.int64)
    doc_end = offsets[np.searchsorted(offsets, start - 1, side="right")]  # [M] end of the n-gram's document
    avail = np.minimum(doc_end - start, length)  # [M] continuation length
    grid = _weight_grid(int(matches.max()) if trees else 1)
    hist = np.zeros(trees * grid.shape[0], dtype=np.int64)  # [B * G] nodes per tree per weight level
    floor = np.zeros(trees, dtype=np.int64)  # [B] lower bound of each tree's size-th heaviest weight
    cur = np.flatnonzero(avail > 0)  # continuations alive
    node = tree[cur]  # their node at the previous level (level 0: the tree's root)
    prev_tree = np.arange(trees, dtype=np.int64)  # tree of each previous-level node
    prev_rank = np.zeros(trees, dtype=np.int64)  # rank of each previous-level node within its tree and level
    prev_slot = np.arange(trees, dtype=np.int64)  # stored position of each previous-level node in its level
    prev_base, base = 0, 0
    levels: list[tuple[np.ndarray, ...]] = []
    for depth in range(1, length + 1):
        if cur.shape[0] == 0:
            break
        tok = np.asarray(tokens[start[cur] + (depth - 1)]).astype(np.int64)
        perm = lex_order([node, tok])
        node, tok, cur = node[perm], tok[perm], cur[perm]
        is_first = np.r_[True, (node[1:] != node[:-1]) | (tok[1:] != tok[:-1])]
        first = np.flatnonzero(is_first)
        weight = np.diff(np.r_[first, node.shape[0]])  # [U] continuations through each new node
        ids = np.cumsum(is_first) - 1  # [A] node of each continuation
        parent = node[first]
        owner = prev_tree[parent]
        order, slot, rank = rank_level(weight, tok[first], prev_rank[parent], owner=owner)  # the canonical order
        global_parent = prev_slot[parent] + prev_base if depth > 1 else np.full(first.shape[0], -1, dtype=np.int64)
        # stored in output order, so each level is one sorted run for the final merge
        columns = (owner, global_parent, tok[first], weight, np.full(first.shape[0], depth), rank)
        levels.append(tuple(col[order] for col in columns))
        # weights are final when a node is made, a descendant weighs at most its ancestor and is deeper than
        # every node made so far: once a tree has `size` nodes of weight >= f, nothing below a node of
        # weight <= f can make the tree, and nodes lighter than f cannot either
        hist += np.bincount(
            owner * grid.shape[0] + np.searchsorted(grid, weight, side="right") - 1, minlength=hist.shape[0]
        )
        reach = np.cumsum(hist.reshape(trees, -1)[:, ::-1], axis=1) >= size  # [B, G] >= size nodes at level+
        floor = np.where(reach[:, -1], grid[grid.shape[0] - 1 - np.argmax(reach, axis=1)], 0)
        alive = (weight > floor[owner])[ids] & (avail[cur] > depth)
        cur, node = cur[alive], ids[alive]
        prev_tree, prev_rank, prev_slot = owner, rank, slot
        prev_base, base = base, base + first.shape[0]
    return _keep_best(index, occurrences, matches, levels, floor, size)


def _keep_best(
    index: np.ndarray,
    occurrences: np.ndarray,
    matches: np.ndarray,
    levels: list[tuple[np.ndarray, ...]],
    floor: np.ndarray,
    size: int,
) -> TreeBatch:
    """Keep each tree's `size` best nodes in prefix order and renumber their parents within the tree."""
    trees = index.shape[0]
    if not levels:
        empty = np.zeros(0, dtype=np.int32)
        return TreeBatch(
            index, np.zeros(trees + 1, np.int64), empty, empty, empty.astype(np.int64), occurrences, matches
        )
    owner, parent, token, weight, depth, rank = (np.concatenate(col) for col in zip(*levels, strict=True))
    cand = np.flatnonzero(weight >= floor[owner])
    order = cand[best_first(weight[cand], depth[cand], rank[cand], owner=owner[cand])]  # merges sorted runs
    keep = chain_order(order[_first_per_group(owner[order], size)], parent, weight, depth)
    offsets = np.zeros(trees + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner[keep], minlength=trees), out=offsets[1:])
    local = np.full(owner.shape[0], -1, dtype=np.int64)
    local[keep] = np.arange(keep.shape[0]) - offsets[owner[keep]]
    kept_parent = parent[keep]
    parents = np.where(kept_parent >= 0, local[np.maximum(kept_parent, 0)], -1)
    return TreeBatch(
        ngram_index=index,
        offsets=offsets,
        tokens=token[keep].astype(np.int32),
        parents=parents.astype(np.int32),
        weights=weight[keep].astype(np.int64),
        occurrences=occurrences.astype(np.int64),
        matches=matches,
    )
