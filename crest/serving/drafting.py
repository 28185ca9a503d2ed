"""Drafting for a batch: one pipelined store round trip per store per step, and draft sizes that follow the batch.

Each row drafts through its own drafter (a prompt drafter and a merged drafter keep per-request state), but
the store part of every row reads from a `StoreLease`: before the rows draft, `prefetch` asks each shared
`crest_client.Store` for the contexts of all rows that use it in one `draft_many` pipeline, and each lease
hands its row's answer to the row's drafter. A store or database error costs those rows their store drafts
only; a store whose database was down at start (a `PendingStore`) drafts nothing until it connects.

`batch_draft_sizes` chooses how many nodes each row verifies: a batched forward of B rows padded to S slots
costs about `cost(B * S)` (the measured cost of a forward of that many tokens), so it keeps the common cap k
that maximises the batch's expected tokens per second, (B + sum of each row's expected accepted nodes within
k) / cost(B * (1 + k)). As rows join, the same gain costs more and k shrinks, down to no draft at all.
The cost is the calibrated single-sequence curve corrected by what the batched steps actually took
(`StepCost`): a batch pays per row for its own cache and mask, which the calibration does not see.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from crest_client.draft import Draft, path_probabilities

from crest.decoding.sizing import CostModel
from crest.errors import CrestClientError

log = logging.getLogger(__name__)

EXPLORE_EVERY = 16  # steps without a verified draft before a small one is verified anyway (to learn acceptance)

EXPLORE_NODES = 4  # at most this many nodes per row in such a probe

_STORE_ERRORS = (CrestClientError, psycopg.Error, OSError)


class StoreLease:
    """One row's view of a shared store: the batch's prefetched answer for this row's context, else a lookup."""

    def __init__(self, store: Any) -> None:
        self.store = store
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
        except _STORE_ERRORS as exc:
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


class StepCost:
    """The calibrated cost curve times the observed ratio of step time to it, per power-of-two token count."""

    BUCKETS = 16  # token counts 1 .. 2^15

    def __init__(self, prior: CostModel, *, decay: float = 0.8) -> None:
        self.prior, self.decay = prior, decay
        self.ratio = np.full(self.BUCKETS, np.nan)  # [buckets] seconds observed / prior seconds, decayed

    def observe(self, tokens: int, seconds: float) -> None:
        """Record that a step of `tokens` slots (rows x width) took `seconds`."""
        expected = float(self.prior(tokens))
        if tokens < 1 or seconds <= 0 or expected <= 0:
            return
        b = min(self.BUCKETS - 1, int(tokens).bit_length() - 1)
        r = seconds / expected
        old = self.ratio[b]
        self.ratio[b] = r if np.isnan(old) else self.decay * old + (1.0 - self.decay) * r

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        """Return the estimated seconds of a step of `k` slots: the prior, scaled as observed nearby."""
        k = np.asarray(k, dtype=np.float64)
        seen = ~np.isnan(self.ratio)
        if not seen.any():
            return self.prior(k)
        where = np.log2(np.maximum(k, 1.0))
        scale = np.interp(where, np.nonzero(seen)[0].astype(np.float64), self.ratio[seen])  # nearest beyond ends
        return self.prior(k) * scale


def batch_draft_sizes(
    drafts: Sequence[Draft], cost: CostModel | StepCost, *, acceptance_scale: float = 1.0
) -> list[int]:
    """Return each row's draft size: the common cap that maximises the batch's expected tokens per second."""
    rows = len(drafts)
    if rows == 0:
        return []
    lengths = np.array([len(d) for d in drafts], dtype=np.int64)
    top = int(lengths.max())
    if top == 0:
        return [0] * rows
    gains = np.zeros((rows, top + 1), dtype=np.float64)  # [B, k+1] expected accepted nodes within cap k
    for r, draft in enumerate(drafts):
        if len(draft):
            gain = np.cumsum(acceptance_scale * path_probabilities(draft))
            gains[r, 1 : len(draft) + 1] = gain
            gains[r, len(draft) + 1 :] = gain[-1]
    caps = np.arange(top + 1)
    widths = 1 + np.minimum(caps.reshape(-1, 1), lengths.reshape(1, -1)).max(axis=1)  # [k+1] slots S per cap
    rate = (rows + gains.sum(axis=0)) / cost(rows * widths)
    best = int(np.argmax(rate))  # the first maximum: no draft when nothing pays
    return [int(min(best, n)) for n in lengths]


def expected_nodes(draft: Draft, size: int) -> float:
    """Return the weight-predicted accepted nodes among the draft's first `size` nodes."""
    return float(path_probabilities(draft)[:size].sum()) if size else 0.0
