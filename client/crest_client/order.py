"""The canonical node order of a draft tree, used by every drafter and by the stored trees.

Nodes are ranked level by level: within one depth by (weight desc, token asc, parent's rank asc), which is
`rank_level`; then the whole tree by (weight desc, depth asc, rank), which is `best_first`. A parent weighs at
least as much as its child and is shallower, so it comes first; weights never increase; and every prefix of
the order is the heaviest subtree of its size. Both functions take an optional `owner` column so that one call
orders many trees at once (ingest builds trees in batches); `order_small` computes the same order in plain
Python for small trees. Stored trees refine the order once more
(`chain_order`): each chain of equal-weight nodes (a node, its child of the same weight, and so on) is made
contiguous at its head's place. That keeps all three properties and lets the codec store most parents as
"the previous node" in one bit; drafters' trees are never encoded, so they keep the plain order.
"""

from __future__ import annotations

import numpy as np


def lex_order(columns: list[np.ndarray]) -> np.ndarray:
    """Return the permutation sorting rows by non-negative int columns (first most significant), ties by row."""
    size = int(columns[0].shape[0])
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    widths = [int(col.max()).bit_length() for col in columns]
    index_bits = (size - 1).bit_length()
    if sum(widths) > 64:
        return np.lexsort(columns[::-1])
    key = np.zeros(size, dtype=np.uint64)
    for col, bits in zip(columns, widths, strict=True):
        key <<= np.uint64(bits)
        key |= col.astype(np.uint64)
    if sum(widths) + index_bits > 64:
        return np.argsort(key, kind="stable")
    key <<= np.uint64(index_bits)
    key |= np.arange(size, dtype=np.uint64)
    key.sort(kind="stable")  # a value sort with the row in low bits; timsort runs make presorted input fast
    return (key & np.uint64((1 << index_bits) - 1)).astype(np.int64)


def rank_level(
    weight: np.ndarray, token: np.ndarray, parent_rank: np.ndarray, *, owner: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order one depth's nodes by (owner, weight desc, token, parent's rank); return (order, slot, rank).

    `order` lists the nodes in that order, `slot[i]` is node i's place in it and `rank[i]` its place within
    its owner's level (from 0); `parent_rank` is 0 for children of the root.
    """
    size = weight.shape[0]
    owner = np.zeros(size, dtype=np.int64) if owner is None else owner
    if size == 0:
        return owner, owner, owner
    order = lex_order([owner, int(weight.max()) - weight, token, parent_rank])  # [U]
    slot = np.empty(size, dtype=np.int64)  # [U]
    slot[order] = np.arange(size)
    return order, slot, slot - np.searchsorted(owner[order], owner)


def best_first(
    weight: np.ndarray, depth: np.ndarray, rank: np.ndarray, *, owner: np.ndarray | None = None
) -> np.ndarray:
    """Return the permutation putting nodes in the order (owner, weight desc, depth, rank in the level)."""
    if weight.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    owner = np.zeros(weight.shape[0], dtype=np.int64) if owner is None else owner
    return lex_order([owner, int(weight.max()) - weight, depth, rank])


def order_small(tokens: list[int], parents: list[int], weights: list[int]) -> list[int]:
    """Return the canonical order of a small tree held in Python lists (parents first), as node indices.

    The same order as `rank_level` then `best_first`, computed with Python sorts of key tuples: for the few dozen
    nodes of a prompt-lookup or merged tree, numpy's cost per call would dominate.
    """
    depth: list[int] = []
    levels: list[list[int]] = []  # node indices by depth - 1
    for i, up in enumerate(parents):
        d = depth[up] + 1 if up >= 0 else 1
        depth.append(d)
        if d > len(levels):
            levels.append([])
        levels[d - 1].append(i)
    rank = [0] * len(tokens)
    for level in levels:  # rank within a level by (weight desc, token, parent's rank); parents' ranks are final
        keys = sorted([(-weights[i], tokens[i], rank[parents[i]] if parents[i] >= 0 else 0, i) for i in level])
        for r, key in enumerate(keys):
            rank[key[3]] = r
    return [key[3] for key in sorted([(-weights[i], depth[i], rank[i], i) for i in range(len(tokens))])]


def chain_order(keep: np.ndarray, parent: np.ndarray, weight: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Reorder kept nodes so each equal-weight chain (a node, then its child of the same weight...) is contiguous.

    `keep` lists node indices in the canonical order; `parent`, `weight` and `depth` are indexed by node. A
    node has at most one child of its own weight, so the nodes of one weight form disjoint chains; each chain
    moves to its head's place, so parents still come first, weights still never increase and every prefix
    still weighs the most a subtree of its size can.
    """
    pos = np.full(parent.shape[0], -1, dtype=np.int64)
    pos[keep] = np.arange(keep.shape[0])
    up = parent[keep]  # [K] index of each kept node's parent, -1 = root
    head = np.where((up < 0) | (weight[np.maximum(up, 0)] != weight[keep]), np.arange(keep.shape[0]), pos[up])
    while True:  # pointer jumping: chains are at most a continuation long
        nxt = head[head]
        if np.array_equal(nxt, head):
            break
        head = nxt
    return keep[np.lexsort((depth[keep], head))]
