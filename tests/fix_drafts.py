"""Drafts in tests: `check_invariants` asserts what the verifier relies on (a valid tree in the stored order),
`reference_tree` builds the trie the slow obvious way, `same` compares two drafts, and `trees` draws encodable
trees for the codec's property tests.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from crest_client.draft import Draft
from hypothesis import strategies as st


def check_invariants(draft: Draft | None, max_nodes: int) -> None:
    """Assert what the verifier relies on: a valid tree in the stored order, at most `max_nodes` nodes."""
    if draft is None:
        return
    draft.validate()
    assert 0 <= len(draft) <= max_nodes
    assert draft.tokens.dtype == np.int64 and draft.parents.dtype == np.int32 and draft.weights.dtype == np.int64
    assert (np.diff(draft.weights) <= 0).all()
    siblings = Counter(zip(draft.parents.tolist(), draft.tokens.tolist(), strict=True))
    assert not siblings or max(siblings.values()) == 1  # no duplicate child tokens
    has_parent = draft.parents >= 0
    assert (draft.weights[draft.parents[has_parent]] >= draft.weights[has_parent]).all()
    columns = (-draft.weights, draft.depths(), draft.tokens, draft.parents)
    keys = list(zip(*(c.tolist() for c in columns), strict=True))
    assert all(a < b for a, b in zip(keys, keys[1:], strict=False)), "nodes out of (weight, depth, token, parent) order"


def reference_tree(conts: list[list[int]], tree_size: int, n: int = 0) -> Draft:
    """Build the trie with dicts and place nodes greedily: the smallest (-weight, depth, token, parent) first."""
    weight = Counter(tuple(c[:k]) for c in conts for k in range(1, len(c) + 1))
    placed: dict[tuple[int, ...], int] = {}
    while len(placed) < min(tree_size, len(weight)):
        ready = [p for p in weight if p not in placed and (len(p) == 1 or p[:-1] in placed)]
        best = min(ready, key=lambda p: (-weight[p], len(p), p[-1], placed.get(p[:-1], -1)))
        placed[best] = len(placed)
    paths = sorted(placed, key=placed.__getitem__)
    return Draft(
        np.array([p[-1] for p in paths], dtype=np.int64),
        np.array([placed[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=np.int32),
        np.array([weight[p] for p in paths], dtype=np.int64),
        n,
    )


def same(a: Draft, b: Draft) -> bool:
    """Return whether two drafts have the same tokens, parents, weights and n."""
    return (
        a.tokens.tolist() == b.tokens.tolist()
        and a.parents.tolist() == b.parents.tolist()
        and a.weights.tolist() == b.weights.tolist()
        and a.n == b.n
    )


@st.composite
def trees(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Draw (tokens, parents, weights falling, vocab size) of an encodable tree."""
    vocab = draw(st.sampled_from([2, 255, 256, 257, 49152, 65536, 65537, 151936, 2**31]))
    size = draw(st.integers(0, 300))
    tokens = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size)), dtype=np.int64)
    parents = np.array([draw(st.integers(-1, i - 1)) for i in range(size)], dtype=np.int32)
    top = draw(st.sampled_from([1, 200, 255, 256, 70000, 2**40]))
    weights = np.sort(np.array(draw(st.lists(st.integers(1, top), min_size=size, max_size=size)), dtype=np.int64))[
        ::-1
    ].copy()
    return tokens, parents, weights, vocab
