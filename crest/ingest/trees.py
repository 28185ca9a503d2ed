"""Bulk, vectorised construction of the continuation trees of the selected n-grams.

For each n-gram, from its occurrences (found and sampled by `crest.ingest.occurrences`), take the
`continuation_length` tokens after each kept occurrence (clipped at the document end) and build the trie level by
level: the nodes of depth d are the distinct (parent, token) pairs of the continuations still alive, found by one
integer sort, and a node's weight is the number of continuations through it. A continuation stops once its node
weighs no more than a lower bound of its tree's `tree_size`-th heaviest weight: every deeper node would rank
after all nodes made so far, so pruning is exact. The `tree_size` nodes kept are the first in the canonical order
every drafter uses (`crest_client.order`: weight desc, depth asc, token asc, parent's position asc), so weights
never increase and every prefix is the heaviest subtree of its size; they are stored in that order refined by
`chain_order` (equal-weight chains made contiguous), which keeps those properties and lets the codec store most
parents in one bit. Selected n-grams are processed in groups (one scan each) and the tries in batches, so memory
follows `scan_occurrences` and `batch_occurrences`, not the corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from crest_client.draft import Draft
from crest_client.order import best_first, chain_order, lex_order, rank_level

from crest.errors import ConfigError
from crest.ingest.occurrences import (
    expected_sample,
    find_occurrences,
    first_per_group,
    position_hash,
    prepare_scan,
)

__all__ = ["TreeBatch", "build_trees", "find_occurrences", "lex_order", "position_hash", "trie_batch"]


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
    offsets, vocab, counts = prepare_scan(tokens, doc_offsets, grams, vocab_size, counts, chunk_tokens)
    planned = expected_sample(counts, max_matches)
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
    keep = chain_order(order[first_per_group(owner[order], size)], parent, weight, depth)
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
