"""The drafts a `Store` looked up, kept per tier in bounded LRU caches: by the context's last max-n tokens, and by key.

A private module with public names: `Store` fills a batch's answers from it, looks up the rest and remembers them
(a miss as None), and clears a tier's caches when it follows that tier to a new version.

The key cache answers a context never seen whose suffixes were: it remembers each stored key's tree and each key
a lookup proved absent (a longer suffix the key filter let through). Walking a context's candidate keys longest
first (`crest_client.lookup.candidate_keys`, the ones a lookup would probe), the first one known stored is its
longest stored suffix, provided every longer one is known absent; any unknown one sends the context to the
database. So the answer is the lookup's own, for tiers that draft from their longest stored suffix (the
`expected` rule weighs every stored suffix: its tiers are not key-cached).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from crest_client.draft import Draft
from crest_client.lookup import candidate_keys

_MISSING: Any = object()


class TierCaches:
    """One LRU cache of drafts per tier (static, live), bounded by `size` entries each; 0 caches nothing."""

    def __init__(self, size: int, lock: threading.Lock) -> None:
        self.size = max(0, int(size))
        self.lock = lock  # the store's lock, also held while it switches versions
        self.tiers: tuple[OrderedDict[tuple[int, ...], Draft | None], ...] = (OrderedDict(), OrderedDict())
        self.keys: tuple[OrderedDict[bytes, Draft | None], ...] = (OrderedDict(), OrderedDict())  # None: absent

    def fill(
        self,
        parts: int,
        tails: list[tuple[int, ...]],
        out: list[list[Draft | None]],
        max_nodes: int,
        *,
        keyed: Sequence[Any] = (),
    ) -> list[list[int]]:
        """Fill `out` from the first `parts` tiers' caches; return, per tier, the contexts still to look up.

        `keyed[part]`: that tier's `StoreInfo` where its key cache may answer (None or absent: by tail only).
        """
        if not self.size:  # no cache: every context with a tail is looked up, no lock taken
            todo = [i for i, tail in enumerate(tails) if tail]
            return [todo] + [todo.copy() for _ in range(parts - 1)]
        missing: list[list[int]] = []
        with self.lock:
            for part in range(parts):
                cache, todo = self.tiers[part], []
                for i, tail in enumerate(tails):
                    found = cache.get(tail, _MISSING)
                    if found is not _MISSING:
                        cache.move_to_end(tail)
                    elif tail and part < len(keyed) and keyed[part] is not None:
                        found = self._by_key(part, tail, keyed[part])
                    if found is _MISSING:
                        if tail:
                            todo.append(i)
                    else:
                        out[i][part] = found.truncate(max_nodes) if found is not None else None
                missing.append(todo)
        return missing

    def remember(
        self,
        current: Sequence[bool],
        missing: list[list[int]],
        tails: list[tuple[int, ...]],
        found: dict[tuple[int, int], Draft | None],
        *,
        keyed: Sequence[Any] = (),
    ) -> None:
        """Cache each looked-up tail's draft (None for a miss) in its tier's caches, for tiers still `current`."""
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
                if part < len(keyed) and keyed[part] is not None:
                    looked = [(tails[i], found.get((part, i), _MISSING)) for i in missing[part] if tails[i]]
                    self._learn_keys(part, looked, keyed[part])

    def clear(self, part: int | None = None) -> None:
        """Forget one tier's drafts, or every tier's (the caller holds the lock)."""
        for which, (cache, keys) in enumerate(zip(self.tiers, self.keys, strict=True)):
            if part is None or which == part:
                cache.clear()
                keys.clear()

    def _by_key(self, part: int, tail: tuple[int, ...], info: Any) -> Any:
        """Return the tail's draft as the key cache knows it (None: nothing stored), or `_MISSING` when it cannot."""
        cache = self.keys[part]
        for key in candidate_keys([tail], info)[1]:  # longest first
            found = cache.get(key, _MISSING)
            if found is _MISSING:
                return _MISSING  # a longer suffix may be stored: ask the database
            cache.move_to_end(key)
            if found is not None:
                return found  # every longer candidate is known absent: the longest stored suffix
        return None  # every candidate is known absent (or the filter rules them all out)

    def _learn_keys(self, part: int, looked: list[tuple[tuple[int, ...], Any]], info: Any) -> None:
        """Remember what each lookup proved: its longest stored key's tree, every longer candidate key absent.

        `looked`: (tail, its draft, or `_MISSING` when nothing was stored); a None draft (a corrupt tree) proves
        nothing of the shorter keys, so that lookup teaches nothing.
        """
        cache, width = self.keys[part], info.token_width
        for tail, draft in looked:
            if draft is None:
                continue
            n = draft.n if draft is not _MISSING else 0
            for key in candidate_keys([tail], info)[1]:  # longest first
                if len(key) // width > n:
                    cache[key] = None
                else:
                    if len(key) // width == n:
                        cache[key] = draft
                    break  # shorter keys were not probed past the longest stored one
        while len(cache) > self.size:
            cache.popitem(last=False)
