"""Merging a store's tiers (or any drafters' parts) into one tree, each part scaled by how often it proves right.

`merge_parts` is the one rule: each part's tree is normalised by its root total (a store tree built from a million
continuations and a live or prompt tree built from three count alike), scaled by the part's learned scale and by
its share, and merged (`crest_client.merge.merge_drafts`). `PartScales` learns each part's scale, its observed
ratio of right to predicted nodes, from the context itself: the tokens appended since the last call are the
target's own, so every part's last tree can be checked against them (the nodes along their path count as right,
up to their length), whether or not the verifier kept those nodes. It scores only a call whose context grew from
the previous call's (same length-1 token, at most `LEARN_WINDOW` tokens on), so one `PartScales` follows one
sequence; `Store.draft` keeps one per handle, crest's drafters one per request.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from crest_client.draft import Draft
from crest_client.merge import merge_drafts, score_draft

MIN_SCALE, MAX_SCALE = 0.02, 2.0  # bounds of a merged part's learned scale

LEARN_DECAY = 0.97  # per observed step: the learned scales follow the last ~30 steps

LEARN_WINDOW = 256  # tokens appended since the last call beyond which the scales do not score

TIERS = ("static", "live")  # a store's tiers (`crest_stores.tier`), in `Store.draft_parts` order: the one list


def merge_parts(
    trees: Sequence[Draft | None], scales: Sequence[float], *, max_nodes: int, shares: Sequence[float] | None = None
) -> Draft | None:
    """Return the merged tree of the parts' trees, each scaled (and weighted by its share); None when none drafts."""
    if max_nodes <= 0 or all(t is None or len(t) == 0 for t in trees):
        return None
    shares = [1.0] * len(trees) if shares is None else shares
    weights = [scale * share for scale, share in zip(scales, shares, strict=True)]
    tree = merge_drafts(trees, shares=weights, tree_size=max_nodes)
    return tree if len(tree) else None


class PartScales:
    """Each part's observed ratio of right to predicted nodes, learned from the tokens that followed its trees."""

    def __init__(self, parts: int = 2) -> None:
        self._right = [0.0] * parts  # decayed nodes proved right, per part
        self._predicted = [0.0] * parts  # decayed nodes the part's weights predicted, same depths
        self._last: tuple[int, int, list[Draft | None]] | None = None  # (context length, last token, trees)
        self._lock = threading.Lock()

    def scales(self) -> tuple[float, ...]:
        """Return each part's observed ratio of right to predicted nodes (1.0 before any evidence)."""
        ratios = ((r + 1.0) / (p + 1.0) for r, p in zip(self._right, self._predicted, strict=True))
        return tuple(min(MAX_SCALE, max(MIN_SCALE, x)) for x in ratios)  # Python floats: called every step

    def observe(self, context_ids: Sequence[int] | np.ndarray) -> None:
        """Score the last call's trees against the tokens appended since, when the context grew from it."""
        with self._lock:
            last, self._last = self._last, None
        if last is None:
            return
        length, token, trees = last
        if not length < len(context_ids) <= length + LEARN_WINDOW or int(context_ids[length - 1]) != token:
            return  # a new request, or too far apart to score
        appended = [int(t) for t in context_ids[length:]]
        for which, tree in enumerate(trees):
            if tree is None or len(tree) == 0:
                continue
            right, predicted = score_draft(tree, appended)
            with self._lock:
                self._right[which] = LEARN_DECAY * self._right[which] + right
                self._predicted[which] = LEARN_DECAY * self._predicted[which] + predicted

    def remember(self, context_ids: Sequence[int] | np.ndarray, trees: list[Draft | None]) -> None:
        """Keep this call's trees, scored by the next call (`observe`)."""
        self._last = (len(context_ids), int(context_ids[-1]), trees) if len(context_ids) else None

    def last_trees(self, context_length: int) -> list[Draft | None] | None:
        """Return each part's tree of the call for a context of this length (None when the last call was not it)."""
        last = self._last
        return last[2] if last is not None and last[0] == context_length else None

    def merge(
        self, context_ids: Sequence[int] | np.ndarray, trees: list[Draft | None], *, max_nodes: int
    ) -> Draft | None:
        """Learn from the context, remember the parts' trees and return their merged tree (`merge_parts`)."""
        self.observe(context_ids)
        self.remember(context_ids, trees)
        return merge_parts(trees, self.scales(), max_nodes=max_nodes)
