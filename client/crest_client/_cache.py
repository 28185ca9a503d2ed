"""The drafts a `Store` looked up, kept per tier in a bounded LRU cache keyed by the context's last max-n tokens.

A private module with public names: `Store` fills a batch's answers from it, looks up the rest and remembers them
(a miss as None), and clears a tier's cache when it follows that tier to a new version.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from crest_client.draft import Draft

_MISSING: Any = object()


class TierCaches:
    """One LRU cache of drafts per tier (static, live), bounded by `size` entries each; 0 caches nothing."""

    def __init__(self, size: int, lock: threading.Lock) -> None:
        self.size = max(0, int(size))
        self.lock = lock  # the store's lock, also held while it switches versions
        self.tiers: tuple[OrderedDict[tuple[int, ...], Draft | None], ...] = (OrderedDict(), OrderedDict())

    def fill(
        self, parts: int, tails: list[tuple[int, ...]], out: list[list[Draft | None]], max_nodes: int
    ) -> list[list[int]]:
        """Fill `out` from the first `parts` tiers' caches; return, per tier, the contexts still to look up."""
        if not self.size:  # no cache: every context with a tail is looked up, no lock taken
            todo = [i for i, tail in enumerate(tails) if tail]
            return [todo] + [todo.copy() for _ in range(parts - 1)]
        missing: list[list[int]] = []
        with self.lock:
            for part in range(parts):
                cache, todo = self.tiers[part], []
                for i, tail in enumerate(tails):
                    found = cache.get(tail, _MISSING)
                    if found is _MISSING:
                        if tail:
                            todo.append(i)
                    else:
                        cache.move_to_end(tail)
                        out[i][part] = found.truncate(max_nodes) if found is not None else None
                missing.append(todo)
        return missing

    def remember(
        self,
        current: Sequence[bool],
        missing: list[list[int]],
        tails: list[tuple[int, ...]],
        found: dict[tuple[int, int], Draft | None],
    ) -> None:
        """Cache each looked-up tail's draft (None for a miss) in its tier's cache, for tiers still `current`."""
        if not self.size:
            return
        with self.lock:
            for part, still in enumerate(current):
                if not still:
                    continue  # the version changed meanwhile
                cache = self.tiers[part]
                for i in missing[part]:
                    if tails[i]:
                        cache[tails[i]] = found.get((part, i))
                while len(cache) > self.size:
                    cache.popitem(last=False)

    def clear(self, part: int | None = None) -> None:
        """Forget one tier's drafts, or every tier's (the caller holds the lock)."""
        for which, cache in enumerate(self.tiers):
            if part is None or which == part:
                cache.clear()
