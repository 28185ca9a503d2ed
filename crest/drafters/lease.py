"""Shared store lookups for a batch: one pipelined round trip per store per step, handed to each row's drafter.

Each row drafts through its own drafter (a prompt drafter and a merged drafter keep per-request state), but the
store part of every row reads from a `StoreLease`: before the rows draft, `prefetch` asks each shared
`crest_client.Store` for the contexts of all rows that use it in one `draft_many_parts` round trip (static and
live tiers together), and each lease hands its row's answer to the row's drafter. A lease also carries the
store's in-process recent tier, which needs no round trip. A store or database error
costs those rows their store drafts only; a store whose database was down at start (a `PendingStore`) drafts
nothing until it connects. `crest serve`'s scheduler and the vLLM proposer both draft this way: this module
registers the part "store" (`crest.drafters.parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from crest_client.draft import Draft
from crest_client.names import check_store_name

from crest.drafters.parts import BatchRow, Part, register_part
from crest.drafters.store import STORE_ERRORS, open_store

log = logging.getLogger(__name__)


class StoreLease:
    """One row's view of a shared store: the batch's prefetched answer for this row's context, else a lookup."""

    def __init__(self, store: Any, *, recent: Any = None) -> None:
        self.store = store
        # the store's in-process recent tier (`crest.drafters.recent.RecentIndex`) seen through this row's memo
        self.recent = RecentView(recent) if recent is not None else None
        self._ready: tuple[int, list[Draft | None]] | None = None  # (context length, prefetched [static, live])

    @property
    def live(self) -> Any:
        """Return the shared store's live tier (None when it has none)."""
        return getattr(self.store, "live", None)

    def put(self, context_length: int, parts: list[Draft | None]) -> None:
        """Hold the prefetched [static, live] drafts for the context of this length (taken by the next draft)."""
        self._ready = (context_length, parts)

    def draft(self, context_ids: Sequence[int], max_nodes: int = 64) -> Draft | None:
        """Return the prefetched static draft for this context when there is one, else ask the store."""
        ready = self._take(len(context_ids))
        if ready is not None:
            return _cut(ready[0], max_nodes)
        result: Draft | None = self.store.draft(context_ids, max_nodes=max_nodes)
        return result

    def draft_parts(self, context_ids: Sequence[int], max_nodes: int = 64) -> list[Draft | None]:
        """Return the prefetched [static, live] drafts for this context when there are some, else ask the store."""
        ready = self._take(len(context_ids))
        if ready is not None:
            return [_cut(d, max_nodes) for d in ready]
        return list(self.store.draft_parts(context_ids, max_nodes=max_nodes))

    def _take(self, context_length: int) -> list[Draft | None] | None:
        ready, self._ready = self._ready, None
        return ready[1] if ready is not None and ready[0] == context_length else None


class RecentView:
    """One row's view of a shared recent tier: the last lookup is kept, so asking again for the same context (the
    proposer's deep-match check, then the row's merged drafter) costs one lookup."""

    def __init__(self, index: Any) -> None:
        self.index = index
        # (context length, last token, nodes asked, tree, position after a chain's last node or -1)
        self._last: tuple[int, int, int, Draft | None, int] | None = None

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the recent tier's tree for the context (the kept one when this context was just asked)."""
        return self.follow(context_ids, max_nodes)[0]

    def follow(self, context_ids: Sequence[int], max_nodes: int) -> tuple[Draft | None, int]:
        """Return the recent tier's tree for the context and where a chain goes on in it (`RecentIndex.follow`)."""
        key = (len(context_ids), int(context_ids[-1]) if len(context_ids) else -1)
        last = self._last
        if last is not None and last[:2] == key and max_nodes <= last[2]:  # a prefix of a canonical tree is one
            tree, at = last[3], last[4]
            if tree is not None and max_nodes < len(tree):
                return tree.truncate(max_nodes), (at - len(tree) + max_nodes if at >= 0 else -1)
            return tree, at
        tree, at = self.index.follow(context_ids, max_nodes)
        self._last = (*key, int(max_nodes), tree, at)
        return tree, at

    def tokens_from(self, position: int, length: int) -> list[int]:
        """Return up to `length` tokens of the shared tier from absolute `position` on (`RecentIndex.tokens_from`)."""
        found: list[int] = self.index.tokens_from(position, length)
        return found


def _cut(draft: Draft | None, max_nodes: int) -> Draft | None:
    return draft.truncate(max_nodes) if draft is not None else None


def prefetch(leases: Sequence[StoreLease], contexts: Sequence[Sequence[int]], *, max_nodes: int) -> None:
    """Look up every lease's context, one round trip per distinct store (both tiers); errors give no drafts."""
    groups: dict[int, list[int]] = {}
    for i, lease in enumerate(leases):
        groups.setdefault(id(lease.store), []).append(i)
    for members in groups.values():
        store = leases[members[0]].store
        batch = [contexts[i] for i in members]
        try:
            parts = _draft_many(store, batch, max_nodes)
        except STORE_ERRORS as exc:
            log.debug("store lookup failed, no store drafts this step: %s", exc)
            parts = [[None, None] for _ in members]
        for i, found in zip(members, parts, strict=True):
            leases[i].put(len(contexts[i]), found)


def _draft_many(store: Any, contexts: list[Sequence[int]], max_nodes: int) -> list[list[Draft | None]]:
    """Return the store's [static, live] drafts for all contexts in one round trip (a pending store: none)."""
    parts = getattr(store, "draft_many_parts", None)
    if parts is not None:
        return [list(p) for p in parts(contexts, max_nodes=max_nodes)]
    many = getattr(store, "draft_many", None)  # a store without tiers
    if many is not None:
        return [[d, None] for d in many(contexts, max_nodes=max_nodes)]
    return [[store.draft(c, max_nodes), None] for c in contexts]


def _prefetch_rows(leases: Sequence[StoreLease], rows: Sequence[BatchRow], max_nodes: int) -> None:
    prefetch(leases, [row.context for row in rows], max_nodes=max_nodes)


register_part(
    Part("store", "--store NAME", open_store, check=check_store_name, lease=StoreLease, prefetch=_prefetch_rows)
)
