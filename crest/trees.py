"""Bulk, vectorised construction of continuation trees for the selected n-grams.

For each n-gram: find its occurrences (one scan of the corpus in chunks; when it occurs more than
`max_matches` times, keep the occurrences with the smallest seeded hash of their position, a uniform sample
that does not depend on chunking), take the `continuation_length` tokens after each occurrence (clipped at the
document end), build the trie of these continuations level by level with `np.unique` (a node's weight is the
number of continuations through it), and keep the `tree_size` heaviest nodes ordered by (weight desc, depth
asc, token asc, parent's position asc). Because a parent weighs at least as much as its child and is
shallower, every parent precedes its children, so any prefix of the list is a subtree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from crest.ngrams import valid_starts, window_keys

_LEVELS = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096, 1 << 16, 1 << 20])
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass
class TreeBatch:
    """Trees of several n-grams in CSR form; tree j holds nodes offsets[j]:offsets[j + 1]."""

    ngram_index: np.ndarray  # [B] int64, index into the `ngrams` given to build_trees
    offsets: np.ndarray  # [B + 1] int64
    tokens: np.ndarray  # [N] int32
    parents: np.ndarray  # [N] int32, -1 = child of the root, else index within the same tree
    weights: np.ndarray  # [N] int64


def position_hash(positions: np.ndarray, seed: int) -> np.ndarray:
    """Return a seeded 64-bit mix (splitmix64) of each position: the sampling priority."""
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def _first_per_group(groups: np.ndarray, limit: int) -> np.ndarray:
    """Return a mask keeping the first `limit` entries of each run of equal values in sorted `groups`."""
    if groups.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, groups.shape[0]]))
    return (np.arange(groups.shape[0]) - run_start) < limit


def find_occurrences(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    keys: np.ndarray,
    *,
    n: int,
    vocab_size: int,
    counts: np.ndarray | None = None,
    max_matches: int = 5000,
    seed: int = 0,
    chunk_tokens: int = 1 << 23,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (ngram index, position) of up to `max_matches` sampled occurrences per key, unordered."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    # only n-grams known (or not known not) to occur more than max_matches times need sampling
    heavy = np.ones(keys.shape[0], dtype=bool) if counts is None else np.asarray(counts) > max_matches
    sel_bits = max(1, int(keys.shape[0]).bit_length())
    pri_shift = np.uint64(sel_bits)
    total = int(tokens.shape[0])
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    light_sel: list[np.ndarray] = []
    light_pos: list[np.ndarray] = []
    heavy_sel = np.zeros(0, dtype=np.int64)
    heavy_pos = np.zeros(0, dtype=np.int64)
    for lo in range(0, total, chunk_tokens):
        hi = min(total, lo + chunk_tokens)
        window = np.asarray(tokens[lo : min(total, hi + n - 1)])
        starts = valid_starts(offsets, lo, hi, n)
        if starts.shape[0] and sorted_keys.shape[0]:
            chunk_keys = window_keys(window, starts - lo, n, vocab_size)
            at = np.minimum(np.searchsorted(sorted_keys, chunk_keys), sorted_keys.shape[0] - 1)
            hit = sorted_keys[at] == chunk_keys
            sel, pos = order[at[hit]].astype(np.int64), starts[hit]
            is_heavy = heavy[sel]
            light_sel.append(sel[~is_heavy])
            light_pos.append(pos[~is_heavy])
            heavy_sel = np.concatenate([heavy_sel, sel[is_heavy]])
            heavy_pos = np.concatenate([heavy_pos, pos[is_heavy]])
        if heavy_sel.shape[0] > 2 * chunk_tokens or (hi == total and heavy_sel.shape[0]):
            # bottom-k by seeded hash per n-gram: one sort of (n-gram, hash prefix) packed in a uint64
            packed = (heavy_sel.astype(np.uint64) << np.uint64(64 - sel_bits)) | (
                position_hash(heavy_pos, seed) >> pri_shift
            )
            by = np.argsort(packed)
            keep = by[_first_per_group(heavy_sel[by], max_matches)]
            heavy_sel, heavy_pos = heavy_sel[keep], heavy_pos[keep]
    return np.concatenate([*light_sel, heavy_sel]), np.concatenate([*light_pos, heavy_pos])


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
    batch_occurrences: int = 1 << 21,
    chunk_tokens: int = 1 << 23,
) -> Iterator[TreeBatch]:
    """Yield the continuation trees of `ngrams` ([K, n] int32) in batches, in the order of `ngrams`."""
    ngrams = np.asarray(ngrams, dtype=np.int64).reshape(-1, n)
    vocab = int(vocab_size or (int(tokens.max()) + 1 if tokens.shape[0] else 1))
    vocab = max(vocab, int(ngrams.max()) + 1 if ngrams.size else 1)
    keys = window_keys(ngrams.ravel(), np.arange(0, ngrams.shape[0] * n, n), n, vocab)
    sel, pos = find_occurrences(
        tokens,
        doc_offsets,
        keys,
        n=n,
        vocab_size=vocab,
        counts=counts,
        max_matches=max_matches,
        seed=seed,
        chunk_tokens=chunk_tokens,
    )
    order = np.argsort(sel, kind="stable")
    sel, pos = sel[order], pos[order]
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    bounds = np.searchsorted(sel, np.arange(ngrams.shape[0] + 1))  # occurrences of n-gram i: bounds[i]:bounds[i+1]
    lo = 0
    while lo < ngrams.shape[0]:
        hi = int(np.searchsorted(bounds, bounds[lo] + batch_occurrences, side="right")) - 1
        hi = min(ngrams.shape[0], max(hi, lo + 1))
        a, b = int(bounds[lo]), int(bounds[hi])
        yield _trie_batch(
            tokens, offsets, np.arange(lo, hi), sel[a:b] - lo, pos[a:b] + n, continuation_length, tree_size, vocab
        )
        lo = hi


def _trie_batch(
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    ngram_index: np.ndarray,
    tree: np.ndarray,
    cont_start: np.ndarray,
    length: int,
    tree_size: int,
    vocab: int,
) -> TreeBatch:
    """Build and prune the tries of one batch; `tree[i]` owns the continuation starting at `cont_start[i]`."""
    trees = ngram_index.shape[0]
    doc_end = doc_offsets[np.searchsorted(doc_offsets, cont_start - 1, side="right")]  # [M] end of its document
    node_tree: list[np.ndarray] = []
    node_parent: list[np.ndarray] = []
    node_token: list[np.ndarray] = []
    node_weight: list[np.ndarray] = []
    node_depth: list[np.ndarray] = []
    node_rank: list[np.ndarray] = []  # rank within its level by (tree, weight desc, token, parent's rank)
    prev_rank = np.zeros(0, dtype=np.int64)
    parent_of = np.full(cont_start.shape[0], -1, dtype=np.int64)  # [M] node id of each continuation so far
    alive = np.ones(cont_start.shape[0], dtype=bool)
    next_id = 0
    hist = np.zeros((trees, _LEVELS.shape[0]), dtype=np.int64)  # [B, L] nodes per tree per weight level
    floor = np.ones(trees, dtype=np.int64)  # [B] weight a node needs to be able to make its tree's top tree_size
    for depth in range(1, length + 1):
        at = cont_start + depth - 1
        alive &= at < doc_end
        if not alive.any():
            break
        idx = np.flatnonzero(alive)
        tok = np.asarray(tokens[at[idx]], dtype=np.int64)
        owner = np.where(parent_of[idx] >= 0, parent_of[idx] + trees, tree[idx])  # root of tree t is id t
        pair = owner * vocab + tok
        uniq, inverse, weight = np.unique(pair, return_inverse=True, return_counts=True)
        ids = next_id + np.arange(uniq.shape[0], dtype=np.int64)
        owner_u = uniq // vocab
        level_tree = np.empty(uniq.shape[0], dtype=np.int64)
        level_tree[inverse.ravel()] = tree[idx]  # every continuation through a node belongs to its tree
        level_parent = np.where(owner_u >= trees, owner_u - trees, -1)
        parent_rank = np.zeros(uniq.shape[0], dtype=np.int64)
        if prev_rank.shape[0]:
            parent_rank = prev_rank[np.maximum(level_parent - (next_id - prev_rank.shape[0]), 0)]
        level_order = np.lexsort((parent_rank, uniq % vocab, -weight, level_tree))
        prev_rank = np.empty(uniq.shape[0], dtype=np.int64)
        prev_rank[level_order] = np.arange(uniq.shape[0])
        node_rank.append(prev_rank)
        node_parent.append(level_parent)
        node_tree.append(level_tree)
        node_token.append(uniq % vocab)
        node_weight.append(weight.astype(np.int64))
        node_depth.append(np.full(uniq.shape[0], depth, dtype=np.int64))
        parent_of[idx] = ids[inverse.ravel()]
        next_id += uniq.shape[0]
        # node weights are final when created and a child weighs at most its parent: once a tree has
        # tree_size nodes of weight >= w, lighter nodes and all their descendants can be dropped exactly
        np.add.at(hist, (level_tree, np.searchsorted(_LEVELS, weight, side="right") - 1), 1)
        enough = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1] >= tree_size  # [B, L] >= tree_size nodes at level+
        floor = np.where(enough.any(axis=1), _LEVELS[enough.shape[1] - 1 - np.argmax(enough[:, ::-1], axis=1)], 1)
        alive[idx] &= weight[inverse.ravel()] >= floor[tree[idx]]
    if next_id == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TreeBatch(
            ngram_index, np.zeros(trees + 1, dtype=np.int64), empty.astype(np.int32), empty.astype(np.int32), empty
        )
    parent = np.concatenate(node_parent)
    token = np.concatenate(node_token)
    weight = np.concatenate(node_weight)
    depth_all = np.concatenate(node_depth)
    owner_tree = np.concatenate(node_tree)
    level_rank = np.concatenate(node_rank)
    heavy = np.flatnonzero(weight >= floor[owner_tree])
    order = heavy[_node_order(owner_tree[heavy], weight[heavy], depth_all[heavy], level_rank[heavy])]
    keep = order[_first_per_group(owner_tree[order], tree_size)]
    local = np.full(next_id, -1, dtype=np.int64)
    counts = np.bincount(owner_tree[keep], minlength=trees)
    offsets = np.zeros(trees + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    local[keep] = np.arange(keep.shape[0]) - offsets[owner_tree[keep]]
    kept_parent = parent[keep]
    parents_local = np.where(kept_parent >= 0, local[np.maximum(kept_parent, 0)], -1)
    return TreeBatch(
        ngram_index=ngram_index.astype(np.int64),
        offsets=offsets,
        tokens=token[keep].astype(np.int32),
        parents=parents_local.astype(np.int32),
        weights=weight[keep],
    )


def _node_order(tree: np.ndarray, weight: np.ndarray, depth: np.ndarray, level_rank: np.ndarray) -> np.ndarray:
    """Return the node order (tree, weight desc, depth, rank within the level) with one integer sort when it fits."""
    wmax = int(weight.max())
    widths = [int(x.max()).bit_length() for x in (tree, weight, depth, level_rank)]
    if sum(widths) > 63:
        return np.lexsort((level_rank, depth, -weight, tree))
    key = tree.astype(np.int64)
    for part, bits in ((wmax - weight, widths[1]), (depth, widths[2]), (level_rank, widths[3])):
        key = (key << bits) | part.astype(np.int64)
    return np.argsort(key)
