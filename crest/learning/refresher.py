"""The thread that refreshes live tiers: what any process on the database learned becomes everyone's live drafts.

A `Refresher` calls `crest.learning.refresh_live` for every store it is given every `interval` seconds, in a
daemon thread; `crest serve` runs one for the stores it opened, and crest's vLLM proposer one for its store, so a
fleet learns without a separate `crest refresh`. Concurrent refreshes of one store from several processes are
serialised by `refresh_live`: one publishes, the others skip while it holds the lock (busy) or find nothing new.
Failures are counted and logged once per kind, never raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial

from crest_client.names import resolve_dsn

from crest.config import (
    DEFAULT_LEARN_DENSE_WINDOW,
    DEFAULT_LEARN_WINDOW,
    DEFAULT_REFRESH_INTERVAL,
    DEFAULT_REFRESH_MIN_TOKENS,
)
from crest.learning.live import refresh_live

log = logging.getLogger(__name__)


class Refresher:
    """A thread that refreshes the live tier of every opened store every `interval` seconds; it never raises."""

    def __init__(
        self,
        dsn: str | None,
        stores: Callable[[], Iterable[str]],
        *,
        interval: float = DEFAULT_REFRESH_INTERVAL,
        window: int = DEFAULT_LEARN_WINDOW,
        min_new_tokens: int = DEFAULT_REFRESH_MIN_TOKENS,
        on_result: Callable[[str], None] | None = None,
        dense_window: int = DEFAULT_LEARN_DENSE_WINDOW,
    ) -> None:
        self.dsn, self.stores, self.interval = dsn, stores, float(interval)
        self.window, self.min_new_tokens, self.dense_window = window, int(min_new_tokens), dense_window
        self.on_result = on_result
        self.counts = {"published": 0, "nothing": 0, "failed": 0}
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start refreshing in a daemon thread (not when the interval is 0)."""
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="crest-refresh", daemon=True)
            self._thread.start()

    def stop(self, *, timeout: float | None = 10.0) -> None:
        """Stop the thread after the refresh in progress (waiting at most `timeout` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def refresh_once(self) -> dict[str, str]:
        """Refresh every opened store once; return each store's result: published, nothing, busy or failed.

        busy: another refresh of the store (another process's) held its lock, so this one skipped it.
        """
        results: dict[str, str] = {}
        for name in list(self.stores()):
            busy: list[bool] = []
            try:
                found = refresh_live(
                    resolve_dsn(self.dsn),
                    name,
                    window=self.window,
                    min_new_tokens=self.min_new_tokens,
                    dense_window=self.dense_window,
                    on_busy=partial(busy.append, True),
                )
                results[name] = "published" if found is not None else "busy" if busy else "nothing"
            except Exception as exc:  # a database that is down or a failed build costs this refresh only
                results[name] = "failed"
                self._warn(name, exc)
            self._count(results[name])
        return results

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh_once()

    def _count(self, result: str) -> None:
        self.counts[result] = self.counts.get(result, 0) + 1  # busy: counted once it happens
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception as exc:
                log.debug("a refresh counter failed: %s", exc)

    def _warn(self, name: str, exc: Exception) -> None:
        kind = type(exc).__name__
        reason = " ".join(str(exc).split())
        if kind in self._warned:
            log.debug("refreshing the live tier of %r failed again: %s: %s", name, kind, reason)
            return
        self._warned.add(kind)
        log.warning("refreshing the live tier of %r failed (said once per kind): %s: %s", name, kind, reason)
