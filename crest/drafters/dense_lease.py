"""Shared dense lookups for a batch: one ANN statement per dense index per step, handed to each row's dense drafter.

As `crest.drafters.lease` does for the n-gram store, `crest serve` opens each store's dense part once
(`DenseIndex`) and gives every row that drafts from it a `DenseLease`, which stands in for the index inside the
row's `DenseDrafter`. Before the rows draft, the scheduler hands each row's drafter the hidden state that
predicted its last token and `prefetch_dense` sends the states of all rows of one index as one batched search
(`DenseIndex.search`, one statement); each lease then answers its row's search from that batch. A search the
batch did not prefetch (another state, another `k`) goes to the index itself. A database that is down gives
every row no neighbours (no dense drafts, no error), as the index does alone. This module registers the part
"dense_index" (`crest.drafters.parts`): rows whose state is unknown this step are not searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from crest_client.names import check_store_name

from crest.drafters.dense_index import NEIGHBOURS, Neighbours, open_dense
from crest.drafters.parts import BatchRow, Part, register_part


class DenseLease:
    """One row's view of a shared dense index: the batch's neighbours for this row's state, else a search."""

    def __init__(self, index: Any) -> None:
        self.index = index
        self._ready: tuple[np.ndarray, int, Neighbours] | None = None  # (query state [H], k, its neighbours)

    def check_model(self, fingerprint: str) -> None:
        """Check the querying model against the shared index's dense part (ModelError if another)."""
        self.index.check_model(fingerprint)

    def put(self, hidden: np.ndarray, k: int, found: Neighbours) -> None:
        """Hold the prefetched neighbours of this state (taken by the next search)."""
        self._ready = (hidden, k, found)

    def search(self, hidden: np.ndarray, *, k: int) -> list[Neighbours]:
        """Return the prefetched neighbours when this is the state [1, H] they were fetched for, else search."""
        ready, self._ready = self._ready, None
        if ready is not None and len(hidden) == 1 and ready[1] == k and np.array_equal(ready[0], hidden[0]):
            return [ready[2]]
        found: list[Neighbours] = self.index.search(hidden, k=k)
        return found


def prefetch_dense(leases: Sequence[DenseLease], hidden: Sequence[np.ndarray], *, k: int = NEIGHBOURS) -> None:
    """Search every lease's state [H] (its row's), one statement per distinct index, and hand each its answer."""
    groups: dict[int, list[int]] = {}
    for i, lease in enumerate(leases):
        groups.setdefault(id(lease.index), []).append(i)
    for members in groups.values():
        states = [np.asarray(hidden[i], dtype=np.float32) for i in members]
        found = leases[members[0]].index.search(np.stack(states), k=k)  # [] per row while the database is down
        for i, state, row in zip(members, states, found, strict=True):
            leases[i].put(state, k, row)


def _prefetch_rows(leases: Sequence[DenseLease], rows: Sequence[BatchRow], max_nodes: int) -> None:
    known = [(lease, row.hidden) for lease, row in zip(leases, rows, strict=True) if row.hidden is not None]
    if known:
        prefetch_dense([lease for lease, _ in known], [state for _, state in known])


register_part(
    Part(
        "dense_index",
        "--store NAME with a dense part (build one with `crest ingest ... --dense-model MODEL`)",
        open_dense,
        check=check_store_name,
        lease=DenseLease,
        prefetch=_prefetch_rows,
    )
)
