"""The merged drafter (`crest+prompt`): one tree from two drafters, each part weighted by how often it proves right."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from crest_client.draft import Draft

from crest.drafters.protocol import Drafter, drafted_parts
from crest.drafters.trie import merge_drafts, score_draft

log = logging.getLogger(__name__)


MIN_SCALE, MAX_SCALE = 0.02, 2.0  # bounds of a merged part's learned scale


LEARN_DECAY = 0.97  # per observed step: the learned scales follow the last ~30 steps


LEARN_WINDOW = 256  # tokens appended since the last call beyond which a merged drafter does not score


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

    def last_trees(self, context_length: int) -> list[Draft | None] | None:
        """Return each part's tree of the call for a context of this length (None when the last call was not it)."""
        last = self._last
        return last[2] if last is not None and last[0] == context_length else None

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return both drafters' parts behind the merged tree drafted for a context of this length."""
        trees = self.last_trees(context_length)
        found: dict[str, Draft] = {}
        for part, part_tree in zip((self.primary, self.secondary), trees or (), strict=False):
            found.update(drafted_parts(part, part_tree, context_length=context_length))
        return found

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
