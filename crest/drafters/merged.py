"""The merged drafter (`crest+prompt`): one tree from two drafters, each part weighted by how often it proves right.

The rule (normalise each part's tree, scale it by its learned ratio of right to predicted nodes, merge) is the
torch-free client's (`crest_client.tiers`: `merge_parts`, `PartScales`), the same the SDK's `Store.draft` merges a
store's tiers with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from crest_client.draft import Draft
from crest_client.merge import merge_chain
from crest_client.tiers import LEARN_DECAY, LEARN_WINDOW, MAX_SCALE, MIN_SCALE, PartScales, merge_parts

from crest.decoding.drafter import Drafter, drafted_parts, drafted_source

log = logging.getLogger(__name__)

__all__ = ["LEARN_DECAY", "LEARN_WINDOW", "MAX_SCALE", "MIN_SCALE", "MergedDrafter"]


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
        self._scales = PartScales(2)

    def scales(self) -> tuple[float, float]:
        """Return each part's observed ratio of right to predicted nodes (1.0 before any evidence)."""
        a, b = self._scales.scales()
        return a, b

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the merged tree of both drafters' trees, or None when neither drafts."""
        trees = self._parts(context_ids, max_nodes)
        return merge_parts(trees, self.scales(), max_nodes=max_nodes, shares=(1.0, self.secondary_share))

    def _parts(self, context_ids: Sequence[int], max_nodes: int) -> list[Draft | None]:
        """Learn from the context, then return (and remember) both drafters' trees for it."""
        self._scales.observe(context_ids)
        trees = [
            self._part(0, self.primary, context_ids, max_nodes),
            self._part(1, self.secondary, context_ids, max_nodes),
        ]
        self._scales.remember(context_ids, trees)
        return trees

    def draft_chain(self, context_ids: Sequence[int], max_nodes: int, *, depth: int) -> Draft | None:
        """Return the best path of at most `depth` nodes of the tree `draft` merges (`merge_chain`), or None."""
        trees = self._parts(context_ids, max_nodes)
        a, b = self.scales()
        chain = merge_chain(trees, shares=(a, b * self.secondary_share), depth=depth)
        return chain if len(chain) else None

    def last_trees(self, context_length: int) -> list[Draft | None] | None:
        """Return each part's tree of the call for a context of this length (None when the last call was not it)."""
        return self._scales.last_trees(context_length)

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return both drafters' parts behind the merged tree drafted for a context of this length."""
        trees = self.last_trees(context_length)
        found: dict[str, Draft] = {}
        for part, part_tree in zip((self.primary, self.secondary), trees or (), strict=False):
            found.update(drafted_parts(part, part_tree, context_length=context_length))
        return found

    def source_at(self, chain: list[int], *, context_length: int) -> int:
        """Return where the context goes on after `chain`, as either part says it (`drafted_source`), or -1."""
        for part in (self.primary, self.secondary):
            found = drafted_source(part, chain, context_length=context_length)
            if found >= 0:
                return found
        return -1

    def _part(self, which: int, drafter: Drafter, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        try:
            return drafter.draft(context_ids, max_nodes)
        except Exception as exc:  # one failing part must not cost the other part's draft
            if which not in self._failed:
                self._failed.add(which)
                log.warning("drafter %s failed, merging without it (logged once): %s", type(drafter).__name__, exc)
            return None
