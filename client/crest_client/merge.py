"""Merging token trees: one tree from several, each scaled by how far it is trusted, and scoring a tree.

`merge_drafts` merges trees into one trie in the canonical order (`crest_client.order`): a node's weight is the
share-weighted sum of each tree's estimate for it, that tree's weight over its root children's summed weights.
It serves the tier merge (a store's static and live trees, `crest_client.tiers`), crest's merged drafters and the
ingest-time back-off tree of an n-gram and its suffixes. `match_path` walks a tree along known tokens (what
greedy verification accepts) and `score_draft` counts how many of a tree's nodes proved right against the tokens
that followed, for the learned part scales. Torch-free: numpy and Python lists only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crest_client.draft import Draft, path_probabilities
from crest_client.order import order_small

MERGE_SCALE = 1 << 20  # integer weight of a node every continuation of one tree passes through


def ordered(
    tokens: list[int], parents: list[int], weights: list[int], *, tree_size: int, n: int, total: int = 0
) -> Draft:
    """Put a small tree built in Python lists (parents first) in the canonical order and cut it to `tree_size`."""
    order = order_small(tokens, parents, weights)[:tree_size]
    position = {i: k for k, i in enumerate(order)}
    return Draft(
        np.array([tokens[i] for i in order], dtype=np.int64),
        np.array([position[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=np.int32),
        np.array([weights[i] for i in order], dtype=np.int64),
        int(n),
        int(total),
    )


def merge_drafts(
    drafts: Sequence[Draft | None],
    *,
    shares: Sequence[float] | None = None,
    tree_size: int = 64,
    scale: int = MERGE_SCALE,
) -> Draft:
    """Merge trees into one: a node's weight is the share-weighted sum of its acceptance estimates.

    A tree's estimate for a node is its weight over the summed weights of the tree's root children (the
    fraction of that tree's continuations through the node). Weights are made non-increasing down each
    input first, so the merged weights are too; they are scaled by `scale` and rounded (at least 1). The merged
    draft's `total` is `scale`, so shares below 1 lower the estimates instead of being normalised away.
    """
    shares = [1.0] * len(drafts) if shares is None else list(shares)
    given = [(d, share) for d, share in zip(drafts, shares, strict=True) if d is not None and len(d)]
    if len(given) == 1:  # one part drafted (the usual step): scale its weights, its order is kept when it is the same
        alone = _scaled(*given[0], tree_size=tree_size, scale=scale)
        if alone is not None:
            return alone
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
    weights = [max(1, round(m * scale)) for m in mass]
    return ordered(tokens, parents, weights, tree_size=tree_size, n=n, total=int(scale))


def _scaled(draft: Draft, share: float, *, tree_size: int, scale: int) -> Draft | None:
    """Return `merge_drafts([draft])` computed with numpy, or None when the canonical order could differ from the
    tree's (equal weights off a chain): then the merge itself runs."""
    w = draft.weights.astype(np.float64)
    if np.any(w[1:] > w[:-1]):
        return None  # weights that increase somewhere: the merge's min down each path may change them
    total = float(w[draft.parents < 0].sum()) or 1.0
    weights = np.maximum(1, np.round(share * w / total * scale)).astype(np.int64)  # the merge's float steps
    k = len(draft)
    chain = bool(np.array_equal(draft.parents, np.arange(-1, k - 1)))
    if not chain and np.any(weights[1:] >= weights[:-1]):
        return None  # ties: the canonical order breaks them by token and depth
    k = min(k, tree_size)
    tokens, parents = draft.tokens[:k].astype(np.int64), draft.parents[:k].astype(np.int32)
    return Draft(tokens, parents, weights[:k], int(draft.n), int(scale))


def match_path(draft: Draft, tokens: Sequence[int]) -> list[int]:
    """Return the nodes of the deepest draft path spelling a prefix of `tokens`, root child first.

    This is what greedy verification accepts when the target's next tokens are `tokens`.
    """
    parents, ids, known = draft.parents.tolist(), draft.tokens.tolist(), len(tokens)
    depth = [0] * len(ids)
    ok = [False] * len(ids)
    best = -1
    for i, (token, up) in enumerate(zip(ids, parents, strict=True)):  # parents precede children
        depth[i] = depth[up] + 1 if up >= 0 else 1
        ok[i] = (up < 0 or ok[up]) and depth[i] <= known and token == tokens[depth[i] - 1]
        if ok[i] and (best < 0 or depth[i] > depth[best]):
            best = i
    path = []
    while best >= 0:
        path.append(best)
        best = parents[best]
    return path[::-1]


def score_draft(draft: Draft, tokens: Sequence[int]) -> tuple[int, float]:
    """Return (nodes on the path spelled by `tokens`, predicted accepted nodes at depths <= len(tokens))."""
    predicted = float(path_probabilities(draft)[draft.depths() <= len(tokens)].sum())
    return len(match_path(draft, tokens)), predicted
