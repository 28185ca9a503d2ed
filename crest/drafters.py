"""Drafters: everything that proposes a token tree for the verifier, behind one small protocol.

`draft(context_ids, max_nodes) -> Draft | None`. `none` drafts nothing (plain decoding through the same
loop); `prompt` matches the context's longest repeated suffix earlier in the request itself (prompt lookup
decoding); `crest` asks a store through the SDK (`StoreDrafter`); `rest` searches the REST baseline's
suffix array (`crest.rest`); `crest+prompt` merges the store's tree and the prompt's tree into one
(`MergedDrafter`). Every returned tree keeps the order of stored trees: weight descending, then depth, then
token id, then the parent's position, so parents precede children and `draft.truncate(k)` is the best
subtree of k nodes. `build_draft` builds that tree from a set of continuations (REST's Algorithm 2).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import psycopg
from crest_client.draft import Draft, empty_draft

from crest.errors import ConfigError, CrestClientError

log = logging.getLogger(__name__)

NAMES = ("none", "prompt", "rest", "crest", "crest+prompt")
MERGE_SCALE = 1 << 20  # integer weight of a node every continuation of one tree passes through
MIN_SCALE, MAX_SCALE = 0.02, 2.0  # bounds of a merged part's learned scale
LEARN_DECAY = 0.97  # per observed step: the learned scales follow the last ~30 steps
LEARN_WINDOW = 256  # tokens appended since the last call beyond which a merged drafter does not score
_SMALL = 320  # continuation tokens (rows x width) up to which a Python dict builds the trie faster than numpy
_STORE_ERRORS = (CrestClientError, psycopg.Error, OSError)  # OSError covers socket errors and TimeoutError


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes a draft tree for a context."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None: ...


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
    """Order a small tree (parents first) by (weight desc, depth, token, parent's position) and cut it."""
    depth: list[int] = []
    for up in parents:
        depth.append(depth[up] + 1 if up >= 0 else 1)
    rank = [0] * len(tokens)
    levels: dict[int, list[int]] = {}
    for i, d in enumerate(depth):
        levels.setdefault(d, []).append(i)
    for d in sorted(levels):  # rank within a level by (weight desc, token, parent's rank)
        level = levels[d]
        level.sort(key=lambda i: (-weights[i], tokens[i], rank[parents[i]] if parents[i] >= 0 else -1))
        for r, i in enumerate(level):
            rank[i] = r
    order = sorted(range(len(tokens)), key=lambda i: (-weights[i], depth[i], rank[i]))[:tree_size]
    position = {i: k for k, i in enumerate(order)}
    return Draft(
        np.array([tokens[i] for i in order], dtype=np.int64),
        np.array([position[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=np.int32),
        np.array([weights[i] for i in order], dtype=np.int64),
        int(n),
    )


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
    """Keep the `tree_size` first nodes in the order (weight desc, depth, token, parent's position)."""
    size = tokens.shape[0]
    if size == 0 or tree_size <= 0:
        return empty_draft(n)
    keep = np.arange(size)
    if size > tree_size:  # a cheap cut on (weight desc, depth) before the exact order
        coarse = -weights * (int(depth.max()) + 1) + depth
        keep = np.flatnonzero(coarse <= np.partition(coarse, tree_size - 1)[tree_size - 1])
    by = (tokens[keep], depth[keep], -weights[keep])
    order = keep[np.lexsort(by)]
    same = [np.diff(a[order]) == 0 for a in (weights, depth, tokens)]
    if (same[0] & same[1] & same[2]).any():  # equal tokens under different parents: order by the parents
        position = np.zeros(size, dtype=np.int64)
        for _ in range(int(depth[keep].max())):  # depth d is settled after d rounds; usually one suffices
            position[order] = np.arange(order.shape[0])
            parent_position = np.where(parents[keep] >= 0, position[np.maximum(parents[keep], 0)], -1)
            again = keep[np.lexsort((parent_position, *by))]
            if np.array_equal(again, order):
                break
            order = again
    order = order[:tree_size]
    position = np.full(size, -1, dtype=np.int64)
    position[order] = np.arange(order.shape[0])
    new_parents = np.where(parents[order] >= 0, position[np.maximum(parents[order], 0)], -1)
    return Draft(tokens[order].astype(np.int64), new_parents.astype(np.int32), weights[order].astype(np.int64), int(n))


def merge_drafts(
    drafts: Sequence[Draft | None], *, shares: Sequence[float] | None = None, tree_size: int = 64
) -> Draft:
    """Merge trees into one: a node's weight is the share-weighted sum of its acceptance estimates.

    A tree's estimate for a node is its weight over the summed weights of the tree's root children (the
    fraction of that tree's continuations through the node). Weights are made non-increasing down each
    input first, so the merged weights are too; they are scaled by `MERGE_SCALE` and rounded. The merged
    draft's `total` is `MERGE_SCALE`, so shares below 1 lower the estimates instead of being normalised away.
    """
    shares = [1.0] * len(drafts) if shares is None else list(shares)
    slot: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    mass: list[float] = []
    n = 0
    for draft, share in zip(drafts, shares, strict=True):
        if draft is None or len(draft) == 0:
            continue
        n = max(n, draft.n)
        weight = draft.weights.astype(np.float64).tolist()
        local: list[int] = []
        for i, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft.parents.tolist(), strict=True)):
            if parent >= 0:
                weight[i] = min(weight[i], weight[parent])
            up = local[parent] if parent >= 0 else -1
            j = slot.setdefault((up, token), len(tokens))
            if j == len(tokens):
                tokens.append(token)
                parents.append(up)
                mass.append(0.0)
            local.append(j)
        total = sum(w for w, p in zip(weight, draft.parents.tolist(), strict=True) if p < 0) or 1.0
        for i, j in enumerate(local):
            mass[j] += share * weight[i] / total
    weights = [max(1, round(m * MERGE_SCALE)) for m in mass]
    return replace(_order(tokens, parents, weights, tree_size=tree_size, n=n), total=MERGE_SCALE)


class NoneDrafter:
    """Drafts nothing: plain decoding through the speculative loop."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return no draft."""
        return None


class PromptDrafter:
    """Prompt lookup: continuations after the most recent earlier occurrences of the context's longest suffix.

    The longest suffix of n tokens (`max_ngram` down to `min_ngram`) that also ends earlier in the context
    wins; the `continuation_length` tokens after each of its `max_matches` most recent occurrences form a
    tree whose weights count the occurrences through each node. The context is kept in a growing buffer
    reused while each call's context extends the previous one (the verifier's case), so a step costs one
    vectorised comparison with the last token plus work on its earlier occurrences. Not thread-safe.
    """

    def __init__(
        self, *, max_ngram: int = 8, min_ngram: int = 2, max_matches: int = 8, continuation_length: int = 10
    ) -> None:
        if not 1 <= min_ngram <= max_ngram or max_matches < 1 or continuation_length < 1:
            raise ConfigError("prompt lookup needs 1 <= min_ngram <= max_ngram, max_matches and length >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_matches, self.continuation_length = max_matches, continuation_length
        self._seen: list[int] = []
        self._buffer = np.zeros(1024, dtype=np.int64)

    def draft(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int) -> Draft | None:
        """Return the tree of continuations after the longest repeated suffix, or None."""
        ctx = self._sync(context_ids)  # [N]
        size = ctx.shape[0]
        top = min(self.max_ngram, size - 1)
        if top < self.min_ngram or max_nodes <= 0:
            return None
        hits = np.flatnonzero(ctx[: size - 1] == ctx[size - 1])  # earlier ends of the last token
        best = 1
        for k in range(1, top):  # extend the match backwards while some occurrence keeps up
            back = hits - k
            longer = hits[(back >= 0) & (ctx[np.maximum(back, 0)] == ctx[size - 1 - k])]
            if not longer.shape[0]:
                break
            hits, best = longer, k + 1
        if best < self.min_ngram or not hits.shape[0]:
            return None
        starts = hits[::-1][: self.max_matches] + 1  # most recent first
        at = starts[:, None] + np.arange(self.continuation_length)  # [M, L]
        rows = np.where(at < size, ctx[np.minimum(at, size - 1)], -1)
        tree = build_draft(rows, tree_size=max_nodes, n=best)
        return tree if len(tree) else None

    def _sync(self, context_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Return the context as an int64 array, reusing the buffer when it extends the last context."""
        ids = context_ids if isinstance(context_ids, list) else np.asarray(context_ids).reshape(-1).tolist()
        known = len(self._seen)
        if len(ids) < known or ids[:known] != self._seen:
            self._seen, known = [], 0
        fresh = [int(t) for t in ids[known:]]
        if fresh:
            need = known + len(fresh)
            if need > self._buffer.shape[0]:
                grown = np.zeros(max(need, 2 * self._buffer.shape[0]), dtype=np.int64)
                grown[:known] = self._buffer[:known]
                self._buffer = grown
            self._buffer[known:need] = fresh
            self._seen.extend(fresh)
        return self._buffer[: len(self._seen)]


class StoreDrafter:
    """Drafts from a crest store through the SDK; store and database errors give no draft for that step."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.failures = 0

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the store's tree for the context (at most `max_nodes` nodes), or None."""
        try:
            tree = self.store.draft(context_ids, max_nodes=max_nodes)
        except _STORE_ERRORS as exc:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(level, "store draft failed, no draft this step (logged once): %s", exc)
            return None
        if tree is None or len(tree) == 0 or max_nodes <= 0:
            return None
        return tree.truncate(max_nodes)


class MergedDrafter:
    """Merges two drafters' trees (`merge_drafts`), each scaled by how often its drafts prove right.

    Each tree's weights are divided by its root total, so a store tree built from a million continuations
    and a prompt tree built from three matches count alike; then each part's estimates are scaled by its
    observed ratio of right to predicted nodes. The drafter learns that ratio from the context itself: the
    tokens appended since its last call are the target's own, so every part's last tree can be checked
    against them (the nodes along their path count as right, up to their length), whether or not the
    verifier kept those nodes. `secondary_share` scales the second tree's estimates further. A part that
    raises is logged once and skipped, so the other part still drafts.
    """

    def __init__(self, primary: Drafter, secondary: Drafter, *, secondary_share: float = 1.0) -> None:
        self.primary, self.secondary, self.secondary_share = primary, secondary, secondary_share
        self._failed: set[int] = set()
        self._right = [0.0, 0.0]  # decayed nodes proved right, per part
        self._predicted = [0.0, 0.0]  # decayed nodes the part's weights predicted, same depths
        self._last: tuple[int, int, list[Draft | None]] | None = None  # (context length, last token, trees)

    def scales(self) -> tuple[float, float]:
        """Return each part's observed ratio of right to predicted nodes (1.0 before any evidence)."""
        a, b = ((r + 1.0) / (p + 1.0) for r, p in zip(self._right, self._predicted, strict=True))
        return float(np.clip(a, MIN_SCALE, MAX_SCALE)), float(np.clip(b, MIN_SCALE, MAX_SCALE))

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the merged tree of both drafters' trees, or None when neither drafts."""
        self._learn(context_ids)
        trees = [
            self._part(0, self.primary, context_ids, max_nodes),
            self._part(1, self.secondary, context_ids, max_nodes),
        ]
        self._last = (len(context_ids), int(context_ids[-1]), trees) if len(context_ids) else None
        if max_nodes <= 0 or all(t is None or len(t) == 0 for t in trees):
            return None
        a, b = self.scales()
        tree = merge_drafts(trees, shares=(a, b * self.secondary_share), tree_size=max_nodes)
        return tree if len(tree) else None

    def _learn(self, context_ids: Sequence[int]) -> None:
        """Score the last call's trees against the tokens appended since, when the context grew from it."""
        if self._last is None:
            return
        length, token, trees = self._last
        self._last = None
        if not length < len(context_ids) <= length + LEARN_WINDOW or int(context_ids[length - 1]) != token:
            return  # a new request, or too far apart to score
        appended = [int(t) for t in context_ids[length:]]
        for which, tree in enumerate(trees):
            if tree is None or len(tree) == 0:
                continue
            right, predicted = score_draft(tree, appended)
            self._right[which] = LEARN_DECAY * self._right[which] + right
            self._predicted[which] = LEARN_DECAY * self._predicted[which] + predicted

    def _part(self, which: int, drafter: Drafter, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        try:
            return drafter.draft(context_ids, max_nodes)
        except Exception as exc:  # one failing part must not cost the other part's draft
            if which not in self._failed:
                self._failed.add(which)
                log.warning("drafter %s failed, merging without it (logged once): %s", type(drafter).__name__, exc)
            return None


def score_draft(draft: Draft, tokens: Sequence[int]) -> tuple[int, float]:
    """Return (nodes on the path spelled by `tokens`, predicted accepted nodes at depths <= len(tokens))."""
    from crest.sizing import path_probabilities

    depth = draft.depths()
    predicted = float(path_probabilities(draft)[depth <= len(tokens)].sum())
    pairs = zip(draft.parents.tolist(), draft.tokens.tolist(), strict=True)
    child = {pair: i for i, pair in enumerate(pairs)}  # (parent, token) -> node
    right, at = 0, -1
    for token in tokens:
        at = child.get((at, token), -2)
        if at < 0:
            break
        right += 1
    return right, predicted


def make_drafter(name: str, *, store: Any = None, rest_index: Any = None) -> Drafter | None:
    """Return the drafter called `name` (none, prompt, rest, crest, crest+prompt) built on its parts.

    `store` is a `crest_client.Store` (or anything with its `draft` method); `rest_index` a
    `crest.rest.RestIndex` or the directory of a saved one.
    """
    key = name.strip().lower()
    if key not in NAMES:
        raise ConfigError(f"unknown drafter {name!r}: use one of {', '.join(NAMES)}")
    if key == "none":
        return NoneDrafter()
    if key == "prompt":
        return PromptDrafter()
    if key == "rest":
        if rest_index is None:
            raise ConfigError("the rest drafter needs a REST index (build one with `crest rest-index build`)")
        from crest.rest import RestDrafter, RestIndex

        index = RestIndex.load(rest_index) if isinstance(rest_index, str | Path) else rest_index
        return RestDrafter(index)
    if store is None:
        raise ConfigError(f"the {key} drafter needs a store (--store NAME)")
    crest = StoreDrafter(store)
    return crest if key == "crest" else MergedDrafter(crest, PromptDrafter())
