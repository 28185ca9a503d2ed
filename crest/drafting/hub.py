"""`DraftHub`: the one composition root of drafting from stores and learning, shared by `crest serve` and vLLM. A hub
opens each store once (`open_store`: a database that is down gives a store that drafts nothing until it answers),
its dense part once when a drafter needs it, and builds every request's drafter on per-row leases of those shared
parts (`row_parts`: the registry's drafter, with what to draft with when a part cannot be used). With learning on,
each store gets a `Learner` (finished requests written to the durable, shared learned log), an in-process
`RecentIndex` (the recent tier: a finished request drafts this process's next step at any depth, and every other
replica's within about a second through the `LearnedFeed`, which also warms it from the log at start) and the
`Refresher` that rebuilds the database's live tiers. `learn` is the one way a finished request teaches its store
(`crest.learning.requests.row_stats` the one shape of its figures). The scheduler's engine and the vLLM proposer
each hold one hub and differ only in how they step.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from crest_client.learner import DenseRows, Learner

from crest.config import (
    DEFAULT_FEED_INTERVAL,
    DEFAULT_LEARN_DENSE_WINDOW,
    DEFAULT_LEARN_WINDOW,
    DEFAULT_REFRESH_INTERVAL,
    DEFAULT_REFRESH_MIN_TOKENS,
)
from crest.drafters.dense_index import DenseIndex, open_dense
from crest.drafters.dense_lease import DenseLease
from crest.drafters.lease import StoreLease
from crest.drafters.parts import lease_part, part_names, part_of
from crest.drafters.recent import RecentIndex, RecentOptions
from crest.drafters.registry import kind_of, make_drafter, usable_kind
from crest.drafters.store import RETRY_INTERVAL, open_store
from crest.learning.feed import LearnedFeed
from crest.learning.refresher import Refresher
from crest.learning.requests import served_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnOptions:
    """How a process learns: record finished requests, feed the recent tier, refresh the live tiers now and then."""

    record: bool = True  # write each finished request's tokens (--learn); per request: the `learn` field
    window: int = DEFAULT_LEARN_WINDOW  # a refresh builds the live tier from the last `window` learned tokens
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL  # 0: this process never refreshes
    refresh_min_tokens: int = DEFAULT_REFRESH_MIN_TOKENS
    max_pending_tokens: int = 1_000_000  # per store: tokens waiting to be written, beyond which the oldest go
    flush_interval: float = 0.05  # seconds a learned row waits at most to be written (replicas are notified then)
    dense_window: int = DEFAULT_LEARN_DENSE_WINDOW  # recorded hidden states a live dense part holds (0: none)
    recent: RecentOptions | None = field(default_factory=RecentOptions)  # None: no recent tier
    feed_interval: float = DEFAULT_FEED_INTERVAL  # seconds between polls of the learned log for other replicas' rows


_HUBS = itertools.count(1)

# seconds a closing hub tries to write what its learners still hold (all stores together): the rest is dropped and
# counted; under `docker stop`'s 10 s grace
CLOSE_TIMEOUT = 5.0


def process_source(kind: str) -> str:
    """Return an id for the `source` of the rows a hub writes: `kind@host:pid`, then `/2`, `/3`... for later hubs.

    A hub's feed skips the rows of its own source (its recent tier took them when they were learned), so two hubs
    in one process (tests, several engines) must not share one.
    """
    n = next(_HUBS)
    return f"{kind}@{socket.gethostname()}:{os.getpid()}" + (f"/{n}" if n > 1 else "")


@dataclass
class RowParts:
    """One request's drafter and the part views it reads through (the scheduler or proposer prefetches them)."""

    drafter: Any  # None: plain decoding
    kind: str  # the drafter kind actually used (a part that cannot be used falls back, `usable_kind`)
    leases: dict[str, Any] = field(default_factory=dict)  # part name -> the row's view (`prefetch_parts` fills it)

    @property
    def lease(self) -> StoreLease | None:
        """Return the row's view of its store (None: the drafter reads none)."""
        return self.leases.get("store")

    @property
    def dense(self) -> DenseLease | None:
        """Return the row's view of its store's dense part (None: the drafter reads none)."""
        return self.leases.get("dense_index")


class DraftHub:
    """Shared stores, dense parts, learners, recent tiers, feed and refresher of one serving process."""

    def __init__(
        self,
        *,
        dsn: str | None,
        read_dsn: str | None = None,
        fingerprint: str | None = None,
        retry_interval: float = RETRY_INTERVAL,
        learning: LearnOptions | None = None,
        source: str = "",
        model_fingerprint: Callable[[], str] | None = None,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        self.dsn, self.read_dsn = dsn, read_dsn or dsn  # lookups (a replica); learning writes to `dsn`
        self.fingerprint, self.retry_interval = fingerprint, retry_interval
        self.learning, self.source = learning, source  # learning None: neither record nor refresh
        self.model_fingerprint = model_fingerprint  # the served model's, checked against a dense part's
        self.on_event = on_event  # (method name, *args): counters of a metrics object
        self._stores: dict[str, Any] = {}
        self._dense: dict[str, DenseIndex] = {}
        self._parts: dict[tuple[str, str], Any] = {}  # (part, store) -> another kind of part, opened once
        self._no_dense: set[str] = set()  # opened stores without a usable dense part
        self._learners: dict[str, Learner] = {}
        self._recent: dict[str, RecentIndex] = {}
        self._lock = threading.Lock()
        self.refresher: Refresher | None = None
        self.feed: LearnedFeed | None = None
        if learning is not None and learning.refresh_interval > 0:
            self.refresher = Refresher(
                dsn, self.opened, interval=learning.refresh_interval, window=learning.window,
                min_new_tokens=learning.refresh_min_tokens, on_result=partial(self._event, "observe_refresh"),
                dense_window=learning.dense_window,
            )  # fmt: skip
        if learning is not None and learning.recent is not None and learning.feed_interval > 0:
            self.feed = LearnedFeed(self.read_dsn, self.recent_indexes, source=source, interval=learning.feed_interval,
                                    listen=True, listen_dsn=dsn)  # fmt: skip

    def start(self) -> None:
        """Start the refresher and the feed threads."""
        if self.refresher is not None:
            self.refresher.start()
        if self.feed is not None:
            self.feed.start()

    def close(self) -> None:
        """Stop the threads, write what was learned (trying for `CLOSE_TIMEOUT` seconds in all), close the stores
        and dense parts."""
        if self.feed is not None:
            self.feed.stop()
        if self.refresher is not None:
            self.refresher.stop()
        with self._lock:
            stores = [*self._stores.values(), *self._dense.values(), *self._parts.values()]
            learners = list(self._learners.values())
            recents = list(self._recent.values())
            self._stores, self._dense, self._learners, self._recent, self._parts = {}, {}, {}, {}, {}
        for recent in recents:
            recent.close()
        end = time.monotonic() + CLOSE_TIMEOUT  # one deadline for all: a database that is down costs it once
        for learner in learners:
            learner.close(timeout=max(0.0, end - time.monotonic()))
        for store in stores:
            try:
                store.close()
            except Exception as exc:
                log.debug("closing a store: %s", exc)

    def store(self, name: str) -> Any:
        """Return the shared store `name`, opening it once (StoreNotFound, FingerprintMismatch, InvalidName)."""
        with self._lock:
            found = self._stores.get(name)
            if found is not None:
                return found
            found = self._stores[name] = open_store(
                name, dsn=self.read_dsn, fingerprint=self.fingerprint, retry_interval=self.retry_interval
            )
            if self.records:
                try:
                    self._learners[name] = self._new_learner(name)
                except Exception as exc:  # no learning for this store, drafting goes on
                    log.warning("store %r will not learn: %s", name, exc)
            if self.learning is not None and self.learning.recent is not None:
                self._recent[name] = RecentIndex(self.learning.recent)
        if self.feed is not None:
            self.feed.wake()  # warm its recent tier now
        return found

    def dense_index(self, name: str) -> DenseIndex:
        """Return store `name`'s shared dense part, opened once (ConfigError without one, ModelError: another model)."""
        with self._lock:
            found = self._dense.get(name)
            if found is None:
                found = open_dense(
                    name, dsn=self.read_dsn, fingerprint=self.fingerprint, retry_interval=self.retry_interval
                )
                try:
                    if self.model_fingerprint is not None:
                        found.check_model(self.model_fingerprint())
                except BaseException:
                    found.close()
                    raise
                self._dense[name] = found
            return found

    def learn_dense(self, name: str) -> Any:
        """Return the projection (`DenseMeta`) that records store `name`'s served states, or None: no dense part."""
        with self._lock:
            if name in self._no_dense:
                return None
        try:
            return self.dense_index(name).meta  # None while its database does not answer
        except Exception as exc:  # no dense part, or another model's: the store learns its tokens only
            log.info("store %r learns no dense entries: %s", name, exc)
            with self._lock:
                self._no_dense.add(name)
            return None

    @property
    def records(self) -> bool:
        """Return whether finished requests are written to their stores' learned logs."""
        return self.learning is not None and self.learning.record

    def opened(self) -> list[str]:
        """Return the names of the stores opened so far."""
        with self._lock:
            return list(self._stores)

    def recent_indexes(self) -> list[tuple[str, RecentIndex]]:
        """Return (store name, recent index) of every opened store with a recent tier."""
        with self._lock:
            return list(self._recent.items())

    def recent(self, name: str) -> RecentIndex | None:
        """Return store `name`'s recent tier (None: not opened, or no recent tier)."""
        with self._lock:
            return self._recent.get(name)

    def store_stats(self) -> dict[str, dict[str, int]]:
        """Return each opened store's lookup counters (the SDK's `Store.stats`; zeros until a pending one connects)."""
        with self._lock:
            opened = dict(self._stores)
        return {name: dict(store.stats) for name, store in opened.items()}

    def learner(self, name: str) -> Learner | None:
        """Return the learner of the opened store `name`, or None (not opened, or this process does not record)."""
        with self._lock:
            return self._learners.get(name)

    def row_parts(self, name: str, store: str | None, *, strict: bool = True) -> RowParts:
        """Return a request's drafter `name` on leases of the shared parts of `store` (opened once).

        Without a store, a kind that needs one drafts with its fallback (`usable_kind`). A dense part that cannot
        be used raises when `strict` (`crest serve`: the request is refused), else its kind's fallback drafts (vLLM:
        a worker never fails for crest); a store that is missing or of another tokenizer raises (StoreNotFound,
        FingerprintMismatch).
        """
        missing = set()
        if store is None:
            missing |= {need for need in part_names() if part_of(need).named_by == "store"}
        elif "dense_index" in kind_of(name).needs and not strict and self._dense_missing(store):
            missing.add("dense_index")
        kind = usable_kind(name, missing)
        needs = kind_of(kind).needs
        if store is not None and "store" not in needs and self.records:
            self.store(store)  # a request that only teaches its store
        leases = {need: self._lease(need, store) for need in needs if store is not None}
        drafter = None if kind == "none" else make_drafter(kind, **leases)
        return RowParts(drafter, kind, leases)

    def part(self, need: str, store: str) -> Any:
        """Return the part `need` of store `store`, opened once (a store, its dense part, another registered part)."""
        if need == "store":
            return self.store(store)
        if need == "dense_index":
            return self.dense_index(store)
        with self._lock:
            found = self._parts.get((need, store))
            if found is None:
                found = self._parts[need, store] = part_of(need).open(
                    store, dsn=self.read_dsn, fingerprint=self.fingerprint, retry_interval=self.retry_interval
                )
            return found

    def _lease(self, need: str, store: str) -> Any:
        """Return one row's view of the part `need` of store `store` (a store's carries its recent tier)."""
        opened = self.part(need, store)
        if need == "store":
            return StoreLease(opened, recent=self.recent(store))
        return lease_part(need, opened)

    def learn(
        self,
        name: str,
        prompt: Sequence[int],
        output: Sequence[int],
        *,
        stats: Mapping[str, int] | None = None,
        dense: DenseRows | None = None,
    ) -> None:
        """Teach store `name` a finished request: its recent tier at once, its learned log in the background."""
        if not output:
            return
        # one row for both: another replica's feed and a restarted process find the tail this process keeps
        ids, tail = served_tokens(prompt, output)
        learner = self.learner(name)
        if learner is not None:  # queued first: a flush right after the request's answer finds it
            learner.learn(ids, prompt_tokens=tail, stats=dict(stats or {}), dense=dense)
        recent = self.recent(name)
        if recent is not None:  # the prompt's tail too: a repeat is found deep at its answer's first step
            recent.add_soon(np.asarray(ids, dtype=np.int64))  # added off the step, before the next lookup

    def _dense_missing(self, store: str) -> bool:
        """Return whether store `store` has no dense part this process can use (said once, at its first try)."""
        try:
            self.dense_index(store)
            return False
        except Exception as exc:
            if store not in self._no_dense:
                log.warning("store %r's dense part cannot be used (%s: %s): drafting without it", store,
                            type(exc).__name__, exc)  # fmt: skip
                self._no_dense.add(store)
            return True

    def _new_learner(self, name: str) -> Learner:
        assert self.learning is not None
        return Learner(
            self.dsn, name, source=self.source, max_pending_tokens=self.learning.max_pending_tokens,
            flush_interval=self.learning.flush_interval, on_written=partial(self._event, "observe_learned"),
            on_dropped=partial(self._event, "observe_learn_dropped"),
        )  # fmt: skip

    def _event(self, method: str, *args: Any) -> None:
        if self.on_event is not None:
            self.on_event(method, *args)
