"""Drafters: everything that proposes a token tree for the verifier, behind one small protocol.

`draft(context_ids, max_nodes) -> Draft | None`. `none` drafts nothing (plain decoding through the same
loop), `prompt` matches the context's own suffix earlier in the request (prompt lookup decoding), `crest`
asks a store through the SDK, `rest` searches the REST baseline's suffix array (`crest.rest`), and
`crest+prompt` merges the store's tree and the prompt's tree into one, so a static store and the request
itself draft together. Every returned tree keeps the prefix-order invariant of stored trees.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from crest_client.draft import Draft

from crest.errors import ConfigError
from crest.verify import Drafter

log = logging.getLogger(__name__)

NAMES = ("none", "prompt", "rest", "crest", "crest+prompt")


def build_draft(continuations: Iterable[Sequence[int]], *, tree_size: int = 64, n: int = 0) -> Draft | None:
    """Build the weighted trie of continuations and keep its `tree_size` best nodes in prefix order."""
    weight: dict[tuple[int, ...], float] = {}
    for cont in continuations:
        path: tuple[int, ...] = ()
        for token in cont:
            path = path + (int(token),)
            weight[path] = weight.get(path, 0) + 1
    return draft_from_weights(weight, tree_size=tree_size, n=n)


def draft_from_weights(weight: dict[tuple[int, ...], float], *, tree_size: int, n: int) -> Draft | None:
    """Order weighted paths (weight desc, depth, token, parent's position) and keep the first `tree_size`."""
    if not weight or tree_size <= 0:
        return None
    rank: dict[tuple[int, ...], int] = {}
    depth = 1
    while True:
        level = [p for p in weight if len(p) == depth]
        if not level:
            break
        level.sort(key=lambda p: (-weight[p], p[-1], rank.get(p[:-1], 0)))
        rank.update({p: i for i, p in enumerate(level)})
        depth += 1
    ordered = sorted(weight, key=lambda p: (-weight[p], len(p), rank[p]))[:tree_size]
    index = {p: i for i, p in enumerate(ordered)}
    tokens = np.array([p[-1] for p in ordered], dtype=np.int64)
    parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in ordered], dtype=np.int32)
    weights = np.array([weight[p] for p in ordered])
    return Draft(tokens, parents, np.round(weights).astype(np.int64), n)


class NoneDrafter:
    """Drafts nothing: plain decoding through the speculative loop."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        return None


class PromptDrafter:
    """Prompt lookup: continuations after earlier occurrences of the context's longest repeated suffix."""

    def __init__(self, *, max_ngram: int = 8, min_ngram: int = 2, max_matches: int = 8, length: int = 10) -> None:
        self.max_ngram, self.min_ngram, self.max_matches, self.length = max_ngram, min_ngram, max_matches, length

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        ctx = np.asarray(context_ids, dtype=np.int64)
        size = ctx.shape[0]
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: size - 1], n)  # [size - n, n] earlier n-grams
            hits = np.flatnonzero((windows == ctx[size - n :]).all(axis=1))
            if hits.shape[0]:
                recent = hits[::-1][: self.max_matches]  # the most recent matches first
                conts = [ctx[h + n : h + n + self.length].tolist() for h in recent]
                return build_draft((c for c in conts if c), tree_size=max_nodes, n=n)
        return None


class StoreDrafter:
    """Drafts from a crest store through the SDK; database errors give no draft for that step."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._warned = False

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        try:
            return self.store.draft(context_ids, max_nodes)
        except Exception as exc:  # the SDK already maps database failures to None; this is a last guard
            if not self._warned:
                self._warned = True
                log.warning("store draft failed (no draft this step): %s", exc)
            return None


class MergedDrafter:
    """Merges two drafters' trees: each node's weight is the sum of its path probabilities in both trees."""

    def __init__(self, primary: Drafter, secondary: Drafter, *, scale: int = 1000) -> None:
        self.primary, self.secondary, self.scale = primary, secondary, scale

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        merged: dict[tuple[int, ...], float] = {}
        n = 0
        for drafter in (self.primary, self.secondary):
            tree = drafter.draft(context_ids, max_nodes)
            if tree is None or len(tree) == 0:
                continue
            n = max(n, tree.n)
            total = float(tree.weights[tree.parents < 0].sum()) or 1.0
            for path, w in zip(tree.paths(), tree.weights.tolist(), strict=True):
                key = tuple(path)
                merged[key] = merged.get(key, 0.0) + self.scale * w / total
        return draft_from_weights(merged, tree_size=max_nodes, n=n) if merged else None


def make_drafter(name: str, *, store: Any = None, rest_index: Any = None) -> Drafter | None:
    """Return the drafter called `name` (none, prompt, rest, crest, crest+prompt)."""
    if name not in NAMES:
        raise ConfigError(f"unknown drafter {name!r}: use one of {', '.join(NAMES)}")
    if name == "none":
        return NoneDrafter()
    if name == "prompt":
        return PromptDrafter()
    if name == "rest":
        if rest_index is None:
            raise ConfigError("the rest drafter needs --rest-index DIR (build one with `crest rest-index build`)")
        from crest.rest import RestDrafter

        return RestDrafter(rest_index)
    if store is None:
        raise ConfigError(f"the {name} drafter needs --store NAME")
    crest = StoreDrafter(store)
    return crest if name == "crest" else MergedDrafter(crest, PromptDrafter())
