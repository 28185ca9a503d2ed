"""Token tries of continuations, in the canonical node order every drafter returns.

`build_draft` builds the weighted trie of a set of continuations (REST's Algorithm 2) and keeps its heaviest
nodes in the canonical order of `crest_client.order` (weight descending, then depth, then token id, then the
parent's position), the order stored trees use too, so parents precede children and any prefix is the best
subtree of its size. `merge_drafts`, `match_path` and `score_draft` live in the torch-free client
(`crest_client.merge`: the store's tier merge uses them) and are handed on from here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from crest_client.draft import Draft, empty_draft
from crest_client.merge import MERGE_SCALE, match_path, merge_drafts, ordered, score_draft
from crest_client.order import best_first, rank_level

__all__ = ["MERGE_SCALE", "build_draft", "match_path", "merge_drafts", "score_draft"]


_SMALL = 320  # continuation tokens (rows x width) up to which a Python dict builds the trie faster than numpy


def build_draft(
    continuations: Sequence[Sequence[int] | np.ndarray] | np.ndarray, *, tree_size: int = 64, n: int = 0
) -> Draft:
    """Build the weighted trie of `continuations` and keep its `tree_size` heaviest nodes in prefix order.

    `continuations` is a list of token sequences or a 2-D array padded with -1 (a row ends at its first
    negative entry). A node's weight is the number of continuations starting with its path.
    """
    rows = _as_rows(continuations)
    if rows.shape[0] == 0 or tree_size <= 0:
        return empty_draft(n)
    if rows.size <= _SMALL:
        return _small_draft(rows, tree_size=tree_size, n=n)
    return _large_draft(rows, tree_size=tree_size, n=n)


def _small_draft(rows: np.ndarray, *, tree_size: int, n: int) -> Draft:
    """Build the trie with a dict: fastest for the few continuations of prompt lookup."""
    slot: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[int] = []
    for row in rows.tolist():
        up = -1
        for token in row:
            if token < 0:
                break
            j = slot.setdefault((up, token), len(tokens))
            if j == len(tokens):
                tokens.append(token)
                parents.append(up)
                weights.append(0)
            weights[j] += 1
            up = j
    return _order(tokens, parents, weights, tree_size=tree_size, n=n)


def _large_draft(rows: np.ndarray, *, tree_size: int, n: int) -> Draft:
    """Build the trie with numpy: for REST's thousands of continuations."""
    tokens, parents, weights, depth = _trie_nodes(rows, tree_size=tree_size)
    return _select(tokens, parents, weights, depth, tree_size=tree_size, n=n)


def _order(tokens: list[int], parents: list[int], weights: list[int], *, tree_size: int, n: int) -> Draft:
    """Put a small tree built in Python lists (parents first) in the canonical order and cut it."""
    return ordered(tokens, parents, weights, tree_size=tree_size, n=n)


def _as_rows(continuations: Sequence[Sequence[int] | np.ndarray] | np.ndarray) -> np.ndarray:
    """Return the continuations as a [M, L] int64 array padded with -1, empty rows dropped."""
    if isinstance(continuations, np.ndarray) and continuations.ndim == 2:
        rows = continuations.astype(np.int64, copy=True)
        pad = rows < 0
        if (pad[:, :-1] & ~pad[:, 1:]).any():  # everything after a row's first pad is pad
            first = np.where(pad.any(axis=1), pad.argmax(axis=1), rows.shape[1])
            rows[np.arange(rows.shape[1]) >= first[:, None]] = -1
    else:
        seqs = [np.asarray(c, dtype=np.int64).reshape(-1) for c in continuations]
        lengths = np.array([s.shape[0] for s in seqs], dtype=np.int64)
        rows = np.full((len(seqs), int(lengths.max(initial=0))), -1, dtype=np.int64)
        if lengths.sum():
            flat = np.concatenate(seqs)
            if (flat < 0).any():
                raise ValueError("continuations hold negative token ids")
            cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            rows[np.repeat(np.arange(len(seqs)), lengths), cols] = flat
    if rows.shape[1] == 0:
        return rows[:0]
    return rows[rows[:, 0] >= 0]


def _sort_order(rows: np.ndarray) -> np.ndarray | None:
    """Return the permutation putting rows in lexicographic order (pads first), None when they already are."""
    if rows.shape[0] < 2:
        return None
    diff = rows[1:] != rows[:-1]  # [M - 1, L]
    first = diff.argmax(axis=1)
    at = np.arange(first.shape[0])
    if not (diff[at, first] & (rows[1:][at, first] < rows[:-1][at, first])).any():
        return None  # REST's suffix-array ranges come sorted
    if int(rows.max()) >= 2**32 - 1:
        return np.lexsort(rows.T[::-1])
    packed = np.ascontiguousarray((rows + 1).astype(">u4"))  # big-endian bytes compare like the tokens
    return np.argsort(packed.view(f"S{4 * rows.shape[1]}").ravel(), kind="stable")


def _trie_nodes(rows: np.ndarray, *, tree_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return trie nodes of `rows` as (tokens, parents, weights, depth); weight = rows through the node.

    Built level by level over the sorted rows, where each node is a run of rows sharing its path. Once
    `tree_size` nodes are known, a deeper node only matters if it outweighs the `tree_size`-th heaviest, so
    lighter runs are not expanded: the result holds the first `tree_size` nodes and is closed under parents.
    """
    order = _sort_order(rows)
    if order is not None:
        rows = rows[order]
    size, width = rows.shape
    first_diff = np.zeros(size, dtype=np.int64)  # first column where a row differs from the one before
    if size > 1:
        diff = rows[1:] != rows[:-1]
        first_diff[1:] = np.where(diff.any(axis=1), diff.argmax(axis=1), width)
    columns = np.ascontiguousarray(rows.T)  # [L, M]
    active = np.ones(size, dtype=bool)  # rows inside nodes still worth expanding
    levels: list[tuple[np.ndarray, np.ndarray]] = []  # (first rows, parents) of each depth's nodes
    known = np.zeros(0, dtype=np.int64)  # weights of all nodes so far
    floor, count = 0, 0  # deeper nodes must outweigh `floor`
    for j in range(width):
        runs = np.flatnonzero(first_diff <= j)  # [G] first rows of the runs sharing j + 1 tokens
        weights = np.diff(runs, append=size)
        pick = (columns[j, runs] >= 0) & active[runs] & (weights > floor)
        starts, weights = runs[pick], weights[pick]
        if not starts.shape[0]:
            break
        parents = np.full(starts.shape[0], -1, dtype=np.int64)
        if j:  # a node's parent is the last node one level up starting at or before its first row
            above = levels[-1][0]
            parents = count - above.shape[0] + np.searchsorted(above, starts, side="right") - 1
        levels.append((starts, parents))
        count += starts.shape[0]
        known = np.concatenate((known, weights))
        if known.shape[0] >= tree_size:
            floor = int(np.partition(known, known.shape[0] - tree_size)[known.shape[0] - tree_size])
        grow = weights > floor
        edges = np.bincount(starts[grow], minlength=size + 1) - np.bincount(
            starts[grow] + weights[grow], minlength=size + 1
        )
        active = np.cumsum(edges[:size]) > 0
    if not levels:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    depth = np.concatenate([np.full(lv[0].shape[0], d + 1) for d, lv in enumerate(levels)])
    tokens = np.concatenate([columns[d, lv[0]] for d, lv in enumerate(levels)])
    return tokens, np.concatenate([lv[1] for lv in levels]), known, depth


def _select(
    tokens: np.ndarray, parents: np.ndarray, weights: np.ndarray, depth: np.ndarray, *, tree_size: int, n: int
) -> Draft:
    """Keep the `tree_size` first nodes in the canonical order (`crest_client.order`), parents renumbered."""
    size = tokens.shape[0]
    if size == 0 or tree_size <= 0:
        return empty_draft(n)
    keep = np.arange(size)
    if size > tree_size:  # a cheap cut on (weight desc, depth); a kept node's parent is kept too
        coarse = -weights * (int(depth.max()) + 1) + depth
        keep = np.flatnonzero(coarse <= np.partition(coarse, tree_size - 1)[tree_size - 1])
    rank = np.zeros(size, dtype=np.int64)  # each kept node's rank within its level
    for d in range(1, int(depth[keep].max()) + 1):  # a level's order needs its parents' ranks
        at = keep[depth[keep] == d]
        up = parents[at]
        rank[at] = rank_level(weights[at], tokens[at], np.where(up >= 0, rank[np.maximum(up, 0)], 0))[2]
    order = keep[best_first(weights[keep], depth[keep], rank[keep])][:tree_size]
    position = np.full(size, -1, dtype=np.int64)
    position[order] = np.arange(order.shape[0])
    new_parents = np.where(parents[order] >= 0, position[np.maximum(parents[order], 0)], -1)
    return Draft(tokens[order].astype(np.int64), new_parents.astype(np.int32), weights[order].astype(np.int64), int(n))
