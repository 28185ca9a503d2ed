"""Learning in the server: what a finished request teaches its store, and the thread that refreshes live tiers.

A finished request (not cancelled, not failed) whose store the server has opened teaches that store what
`crest.learning.requests` says it teaches, through the store's `crest_client.learner.Learner`. A `Refresher`
thread calls `crest.learning.refresh_live` for every opened store every `refresh_interval` seconds, so what
any server on the database learned becomes every server's live drafts; its failures are counted and logged
once per kind, never raised. Learning changes drafts only, never the output: verification keeps it exact.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from crest_client.names import resolve_dsn

from crest.config import DEFAULT_LEARN_WINDOW

log = logging.getLogger(__name__)

DEFAULT_REFRESH_INTERVAL = 10.0  # seconds between refreshes of the live tiers

DEFAULT_REFRESH_MIN_TOKENS = 2048  # learned tokens a refresh waits for before it rebuilds a live tier


@dataclass(frozen=True)
class LearnOptions:
    """How a server learns: record finished requests, and refresh the live tiers of its stores now and then."""

    record: bool = True  # write each finished request's tokens (--learn); per request: the `learn` field
    window: int = DEFAULT_LEARN_WINDOW  # a refresh builds the live tier from the last `window` learned tokens
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL  # 0: this server never refreshes
    refresh_min_tokens: int = DEFAULT_REFRESH_MIN_TOKENS
    max_pending_tokens: int = 1_000_000  # per store: tokens waiting to be written, beyond which the oldest go
    flush_interval: float = 1.0  # seconds between the learners' writes


def server_source() -> str:
    """Return this server's id for the `source` of the rows it writes (host and process)."""
    return f"serve@{socket.gethostname()}:{os.getpid()}"


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
    ) -> None:
        self.dsn, self.stores, self.interval = dsn, stores, float(interval)
        self.window, self.min_new_tokens = window, int(min_new_tokens)
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
        """Refresh every opened store once; return each store's result: published, nothing or failed."""
        from crest.learning import refresh_live

        results: dict[str, str] = {}
        for name in list(self.stores()):
            try:
                found = refresh_live(
                    resolve_dsn(self.dsn),
                    name,
                    window=self.window,
                    min_new_tokens=self.min_new_tokens,
                )
                results[name] = "nothing" if found is None else "published"
            except Exception as exc:  # a database that is down or a failed build costs this refresh only
                results[name] = "failed"
                self._warn(name, exc)
            self._count(results[name])
        return results

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh_once()

    def _count(self, result: str) -> None:
        self.counts[result] += 1
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
