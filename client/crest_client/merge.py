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

from crest_client.draft import Draft, shallow_probabilities
from crest_client.order import order_small

MERGE_SCALE = 1 << 20  # integer weight of a node every continuation of one tree passes through


def ordered(
    tokens: list[int], parents: list[int], weights: list[int], *, tree_size: int, n: int, total: int = 0
) -> Draft:
    """Put a small tree built in Python lists (parents first) in the canonical order and cut it to `tree_size`."""
    order = order_small(tokens, parents, weights)[:tree_size]
    position = [0] * len(tokens)  # node -> its place in the order (a kept node's parent is kept, and earlier)
    for k, i in enumerate(order):
        position[i] = k
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
    tokens, parents, mass, n = _trie(drafts, shares)
    weights = [max(1, round(m * scale)) for m in mass]
    return ordered(tokens, parents, weights, tree_size=tree_size, n=n, total=int(scale))


def merge_chain(
    drafts: Sequence[Draft | None],
    *,
    shares: Sequence[float] | None = None,
    depth: int = 64,
    scale: int = MERGE_SCALE,
) -> Draft:
    """Return the best path of at most `depth` nodes of `merge_drafts`' tree, without ordering or cutting the tree.

    The best path has the most expected accepted tokens: the largest sum of its nodes' path probabilities, which
    in the merged tree are their merged weights over one number (the weights never increase down a path), so the
    path of the largest summed weight. The chain keeps the merged weights and, as its total, the merged root's
    (the sum of its children's weights, or `scale`), so its path probabilities are the merged tree's.
    """
    shares = [1.0] * len(drafts) if shares is None else list(shares)
    given = [(d, share) for d, share in zip(drafts, shares, strict=True) if d is not None and len(d)]
    alone = _alone(*given[0]) if len(given) == 1 else None  # the usual row: one part drafted
    tokens, parents, mass, n = alone if alone is not None else _trie(drafts, shares)
    if not tokens or depth <= 0:
        return Draft(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64), n, int(scale))
    weights = [max(1, round(m * scale)) for m in mass]
    level = [0] * len(tokens)  # depth of each node (parents come first)
    for i, p in enumerate(parents):
        level[i] = level[p] + 1 if p >= 0 else 1
    best = [0] * len(tokens)  # summed weight of the best path of at most `depth` nodes from the node down
    below = [-1] * len(tokens)
    for i in range(len(tokens) - 1, -1, -1):  # children come after their parents: theirs are final here
        if level[i] > depth:
            continue
        best[i] = weights[i] + (best[below[i]] if below[i] >= 0 else 0)
        p = parents[i]
        if p >= 0 and (below[p] < 0 or best[i] >= best[below[p]]):  # ties: the first child, as the order has it
            below[p] = i
    roots = [i for i, p in enumerate(parents) if p < 0]
    path = [max(roots, key=best.__getitem__)]
    while below[path[-1]] >= 0:
        path.append(below[path[-1]])
    total = max(int(scale), sum(weights[i] for i in roots))
    return Draft(
        np.array([tokens[i] for i in path], dtype=np.int64),
        np.arange(-1, len(path) - 1, dtype=np.int32),
        np.array([weights[i] for i in path], dtype=np.int64),
        n,
        total,
    )


def _trie(drafts: Sequence[Draft | None], shares: Sequence[float]) -> tuple[list[int], list[int], list[float], int]:
    """Return the merged trie of the trees (tokens, parents, masses, longest match), parents before children.

    A node's mass is the share-weighted sum of each tree's estimate for it: the tree's weight, made non-increasing
    down the tree, over the summed weights of the tree's root children.
    """
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
    return tokens, parents, mass, n


def _alone(draft: Draft, share: float) -> tuple[list[int], list[int], list[float], int] | None:
    """Return `_trie([draft], [share])` without its dict, or None when that could differ (two siblings share a token).

    Alone, a tree whose siblings all differ is its own trie, node for node: only the masses are computed.
    """
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    if len(set(zip(parents, tokens, strict=True))) != len(tokens):
        return None
    weight = draft.weights.astype(np.float64).tolist()
    for i, parent in enumerate(parents):  # non-increasing down the tree, as `_trie` makes them
        if parent >= 0 and weight[i] > weight[parent]:
            weight[i] = weight[parent]
    total = sum(w for w, p in zip(weight, parents, strict=True) if p < 0) or 1.0
    return tokens, parents, [0.0 + share * w / total for w in weight], draft.n


def _scaled(draft: Draft, share: float, *, tree_size: int, scale: int) -> Draft | None:
    """Return `merge_drafts([draft])` without the merge's trie, or None when that could differ: then it runs.

    Alone, a tree's merged weights are its own scaled (the merge's float steps) and its nodes are the merged
    trie's when no two siblings share a token. The canonical order of those weights is the tree's own order when
    they strictly decrease or the tree is a chain, else `order_small`'s.
    """
    w, parents = draft.weights.tolist(), draft.parents.tolist()  # Python lists: a drafter's tree has tens of nodes
    if any(p >= 0 and w[p] < x for x, p in zip(w, parents, strict=True)):
        return None  # a child outweighs its parent: the merge's min down each path changes it
    tokens = draft.tokens.tolist()
    if len(set(zip(parents, tokens, strict=True))) != len(tokens):
        return None  # two siblings with one token: the merge makes them one node
    total = float(sum(x for x, p in zip(w, parents, strict=True) if p < 0)) or 1.0
    weights = [max(1, round(share * float(x) / total * scale)) for x in w]
    k = min(len(w), tree_size)
    falling = all(a > b for a, b in zip(weights, weights[1:], strict=False))
    if falling or parents == list(range(-1, len(w) - 1)):  # the canonical order is the tree's own
        kept = draft.parents[:k].astype(np.int32)
        return Draft(draft.tokens[:k].astype(np.int64), kept, np.array(weights[:k], dtype=np.int64), draft.n, scale)
    return ordered(tokens, parents, weights, tree_size=tree_size, n=draft.n, total=scale)


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
    # one pass over Python lists (parents before children): `match_path`'s walk and the depths' probabilities
    known = len(tokens)
    prob = shallow_probabilities(draft, known)  # only the nodes within `known` of the root count
    ids, parents = draft.tokens.tolist(), draft.parents.tolist()
    depth = [0] * len(ids)
    ok = [False] * len(ids)
    right, predicted = 0, 0.0
    for i, (token, up) in enumerate(zip(ids, parents, strict=True)):
        d = depth[i] = depth[up] + 1 if up >= 0 else 1
        if d <= known:
            predicted += prob[i]
            if (up < 0 or ok[up]) and token == tokens[d - 1]:
                ok[i] = True
                right = max(right, d)  # the deepest right node: its path holds `d` nodes
    return right, predicted
