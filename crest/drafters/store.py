"""The crest drafter: trees from a crest store through the SDK (`crest_client.Store`), and how a store is opened.

A store or database error costs that step's draft only: it is logged once and the step is verified without a
draft, so generation goes on with the same output. The same holds when the database is down as generation
starts: `open_store` then says once that the store is unreachable and hands back a `PendingStore`, which
drafts nothing, tries to connect again in the background now and then (a step never waits for it), and drafts
from the store once the database answers. A database that answers but has no such store, or a store built
with another tokenizer, is an error at once. When the store has a live tier (trees built from what it
learned from served requests), one lookup returns both tiers' trees and the drafter merges them, each part
weighted by how often its drafts prove right (`MergedDrafter`); without one it drafts the static tree alone.
A store handed over with a recent tier (a `StoreLease`'s `recent`: what this process and its replicas served
moments ago, matched at any depth in memory) merges that tree in as a third part, "recent".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from crest_client.draft import Draft
from crest_client.errors import ConnectionUnavailable
from crest_client.hosts import resolve_read_dsn
from crest_client.names import check_store_name
from crest_client.tiers import TIERS

from crest.drafters.merged import MergedDrafter
from crest.drafters.recent import RecentDrafter
from crest.errors import CrestClientError

log = logging.getLogger(__name__)


STORE_ERRORS = (CrestClientError, psycopg.Error, OSError)  # what a lookup may raise; OSError: sockets, timeouts

CONNECT_TIMEOUT = 1.5  # seconds an attempt to reach the database may take, at start and on each retry

RETRY_INTERVAL = 5.0  # seconds between attempts to reach a database that was down


class StoreDrafter:
    """Drafts from a crest store through the SDK; store and database errors give no draft for that step."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.failures = 0
        self._parts: tuple[int, int, list[Draft | None]] | None = None  # (context length, last token, parts)
        self._tiers = MergedDrafter(_Tier(self, 0), _Tier(self, 1))
        recent = getattr(store, "recent", None)
        self._recent = RecentDrafter(recent) if recent is not None else None
        # the store's tiers (or its static tree alone) merged with the recent tier, each scaled by its own record
        self._with_recent = MergedDrafter(_Stored(self), self._recent) if self._recent is not None else None

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the store's tree for the context (its tiers merged; at most `max_nodes` nodes), or None."""
        if max_nodes <= 0:
            return None
        if self._with_recent is not None:
            return self._with_recent.draft(context_ids, max_nodes)
        return self.draft_stored(context_ids, max_nodes)

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return the static, live and recent trees behind `tree`, drafted for a context of this length."""
        if tree is None or len(tree) == 0:
            return {}
        stored: Draft | None = tree
        found: dict[str, Draft] = {}
        if self._with_recent is not None:
            outer = self._with_recent.last_trees(context_length) or [None, None]
            stored = outer[0]
            if outer[1] is not None and len(outer[1]):
                found["recent"] = outer[1]
            if stored is None or len(stored) == 0:
                return found
        merged = self._tiers.last_trees(context_length)
        tiers = merged if merged is not None else [stored, None]  # no live tier: the static tree itself
        found.update({name: t for name, t in zip(TIERS, tiers, strict=True) if t is not None and len(t)})
        return found

    def draft_stored(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the database's tree for the context: static and live merged, or the static tree alone."""
        if getattr(self.store, "live", None) is None:
            tree = self._call(lambda: self.store.draft(context_ids, max_nodes=max_nodes))
            if getattr(self.store, "live", None) is None:  # still none after the lookup's version check
                return _usable(tree, max_nodes)
        return self._tiers.draft(context_ids, max_nodes)

    def parts(self, context_ids: Sequence[int], max_nodes: int) -> list[Draft | None]:
        """Return [static, live] trees for the context, looked up once per context."""
        key = (len(context_ids), int(context_ids[-1]) if len(context_ids) else -1)
        if self._parts is None or self._parts[:2] != key:
            found = self._call(lambda: self.store.draft_parts(context_ids, max_nodes=max_nodes))
            self._parts = (*key, list(found) if found is not None else [None, None])
        return self._parts[2]

    def _call(self, lookup: Callable[[], Any]) -> Any:
        try:
            return lookup()
        except STORE_ERRORS as exc:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(level, "store draft failed, no draft this step (logged once): %s", exc)
            return None


class _Stored:
    """The database's part of a `StoreDrafter` (static and live), as a drafter for the merge with the recent tier."""

    def __init__(self, owner: StoreDrafter) -> None:
        self.owner = owner

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the store's tiers' tree for the context, or None."""
        return self.owner.draft_stored(context_ids, max_nodes)


class _Tier:
    """One tier of a `StoreDrafter`'s lookup, as a drafter for the tiers' `MergedDrafter`."""

    def __init__(self, owner: StoreDrafter, which: int) -> None:
        self.owner, self.which = owner, which

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return this tier's tree for the context, or None."""
        return _usable(self.owner.parts(context_ids, max_nodes)[self.which], max_nodes)


def _usable(tree: Draft | None, max_nodes: int) -> Draft | None:
    """Return the tree cut to `max_nodes`, or None when it is empty."""
    if tree is None or len(tree) == 0 or max_nodes <= 0:
        return None
    return tree.truncate(max_nodes)


class PendingStore:
    """A store whose database did not answer yet: drafts nothing and connects in the background, now and then.

    `connect` opens the store (a `crest_client.Store`); it is retried at most every `retry_interval` seconds,
    from a background thread started by `draft`, so no step waits for it. Once it succeeds, `draft` and
    `draft_many` ask the store. When the database answers but refuses the store (dropped, or rebuilt with
    another tokenizer), that is logged once and the store is not tried again.
    """

    def __init__(self, connect: Callable[[], Any], *, name: str, retry_interval: float = RETRY_INTERVAL) -> None:
        self.name = name
        self.store: Any = None  # the connected Store, once the database answered
        self._connect = connect
        self._retry_interval = float(retry_interval)
        self._next_try = time.monotonic() + self._retry_interval
        self._trying: threading.Thread | None = None
        self._refused = False
        self._closed = False

    def draft(self, context_ids: Sequence[int], max_nodes: int = 64) -> Draft | None:
        """Return the store's draft once connected, else None (and start a connection attempt when one is due)."""
        store = self.store
        if store is not None:
            result: Draft | None = store.draft(context_ids, max_nodes=max_nodes)
            return result
        self._retry_when_due()
        return None

    def draft_many(self, contexts: Sequence[Sequence[int]], max_nodes: int = 64) -> list[Draft | None]:
        """Return the store's drafts for many contexts in one round trip once connected, else Nones."""
        store = self.store
        if store is not None:
            return list(store.draft_many(contexts, max_nodes=max_nodes))
        self._retry_when_due()
        return [None] * len(contexts)

    @property
    def stats(self) -> dict[str, int]:
        """Return the connected store's lookup counters (`Store.stats`), or none counted before it connects."""
        store = self.store
        return dict(store.stats) if store is not None else {}

    @property
    def live(self) -> Any:
        """Return the connected store's live tier (None before it connects or when it has none)."""
        return getattr(self.store, "live", None)

    def draft_parts(self, context_ids: Sequence[int], max_nodes: int = 64) -> list[Draft | None]:
        """Return [static, live] drafts once connected, else Nones."""
        store = self.store
        if store is not None:
            return list(store.draft_parts(context_ids, max_nodes=max_nodes))
        self._retry_when_due()
        return [None, None]

    def draft_many_parts(self, contexts: Sequence[Sequence[int]], max_nodes: int = 64) -> list[list[Draft | None]]:
        """Return [static, live] drafts for many contexts in one round trip once connected, else Nones."""
        store = self.store
        if store is not None:
            return [list(p) for p in store.draft_many_parts(contexts, max_nodes=max_nodes)]
        self._retry_when_due()
        return [[None, None] for _ in contexts]

    def close(self) -> None:
        """Close the store when it was connected; stop trying otherwise."""
        self._closed = True
        if self.store is not None:
            self.store.close()

    def _retry_when_due(self) -> None:
        if not self._refused and self._trying is None and time.monotonic() >= self._next_try:
            self._trying = threading.Thread(target=self._try, name=f"crest-connect-{self.name}", daemon=True)
            self._trying.start()

    def _try(self) -> None:
        store = None
        try:
            store = self._connect()
        except CrestClientError as exc:
            if not isinstance(exc, ConnectionUnavailable):  # still down says nothing: that was said once
                self._refused = True
                log.warning("the database is back but store %r cannot be used (%s): no store drafts", self.name, exc)
        except Exception as exc:  # an unforeseen failure to connect is one more miss, never a crash
            log.debug("connecting to store %r failed: %s", self.name, exc)
        if store is not None and self._closed:
            store.close()
        elif store is not None:
            log.info("store %r is reachable again: drafting from it", self.name)
            self.store = store
        self._next_try = time.monotonic() + self._retry_interval
        self._trying = None


def open_store(
    name: str,
    *,
    dsn: str | None = None,
    fingerprint: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    retry_interval: float = RETRY_INTERVAL,
) -> Any:
    """Return the published store `name` (a `crest_client.Store`), or a `PendingStore` while the database is down.

    Raises StoreNotFound or FingerprintMismatch when the database answers but the store is missing or was built
    with another tokenizer, InvalidName for a name that is not an identifier and InvalidDsn for a DSN libpq cannot
    use. `dsn` is a reader's: else CREST_READ_DATABASE_URL, else the writers' (`crest_client.hosts`).
    """
    from crest_client import Store

    check_store_name(name)

    def connect() -> Any:
        url = resolve_read_dsn(dsn)
        return Store.connect(url, name, tokenizer_fingerprint=fingerprint, connect_timeout=connect_timeout)

    try:
        return connect()
    except ConnectionUnavailable as exc:
        log.warning(
            "store %r is unreachable, generating without store drafts (retrying every %g s): %s",
            name,
            retry_interval,
            exc,
        )
        return PendingStore(connect, name=name, retry_interval=retry_interval)


def check_store(name: str, *, dsn: str | None = None) -> None:
    """Raise StoreNotFound unless `name` is published (at the read DSN); a database that does not answer passes.

    Commands that load a model call this first, so a mistyped store costs no model load; a database that is
    down is the store drafter's to report (it drafts nothing until the database answers).
    """
    import contextlib

    from crest_client import Store

    check_store_name(name)
    with contextlib.suppress(ConnectionUnavailable):
        url = resolve_read_dsn(dsn)
        Store.connect(url, name, cache_size=0, pool_size=1, connect_timeout=CONNECT_TIMEOUT, live=False).close()
