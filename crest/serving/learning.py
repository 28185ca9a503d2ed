"""Learning in the server: what a finished request teaches its store, and the thread that refreshes live tiers.

A finished request (not cancelled, not failed) whose store the server has opened teaches that store its
prompt's last max-n tokens (the context its first output tokens followed) and its output, written by the
store's `crest_client.learner.Learner` off the decoding path (`record_outcome`). A `Refresher` thread calls
`crest.learning.refresh_live` for every opened store every `refresh_interval` seconds, so what any server on
the database learned becomes every server's live drafts; its failures are counted and logged once per kind,
never raised. Learning changes drafts only, never the output: verification keeps it exact.

Each learned row also says how its request went (`request_stats`): target forwards, new tokens, verified and
accepted draft nodes, and how many accepted tokens each part's tree held before the parts were merged
(`tally_parts`, once per step from the trees the drafters kept: the static tier, the live tier, the prompt).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
from crest_client.draft import Draft
from crest_client.learner import Learner
from crest_client.names import resolve_dsn

from crest.config import DEFAULT_LEARN_WINDOW, IngestOptions
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.store import StoreDrafter

log = logging.getLogger(__name__)

DEFAULT_REFRESH_INTERVAL = 10.0  # seconds between refreshes of the live tiers

DEFAULT_REFRESH_MIN_TOKENS = 2048  # learned tokens a refresh waits for before it rebuilds a live tier


PARTS = ("static", "live", "prompt")  # the parts of a crest draft whose accepted tokens a learned row counts


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


def store_max_n(store: Any, *, default: int = IngestOptions().max_n) -> int:
    """Return the longest n-gram an opened store keys on (a store still connecting: the ingest default)."""
    inner = getattr(store, "store", None) or store  # a PendingStore once its database answered
    return int(getattr(getattr(inner, "info", None), "max_n", default))


def served_tokens(prompt: Sequence[int], output: Sequence[int], *, max_n: int) -> tuple[list[int], int]:
    """Return the ids a finished request teaches (the prompt's last max_n, then the output) and that tail's length."""
    tail = [int(t) for t in prompt[max(0, len(prompt) - max_n) :]] if max_n > 0 else []
    return tail + [int(t) for t in output], len(tail)


def drafted_parts(drafter: Any, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
    """Return the parts' trees behind `tree`, the drafter's draft for a context of this length, by part name."""
    if isinstance(drafter, MergedDrafter):
        trees = drafter.last_trees(context_length)
        if trees is None:  # it did not draft for this context
            return {}
        found: dict[str, Draft] = {}
        for part, part_tree in zip((drafter.primary, drafter.secondary), trees, strict=True):
            found.update(drafted_parts(part, part_tree, context_length=context_length))
        return found
    if tree is None or len(tree) == 0:
        return {}
    if isinstance(drafter, StoreDrafter):
        tiers = zip(("static", "live"), drafter.drafted_tiers(context_length, tree), strict=True)
        return {name: t for name, t in tiers if t is not None and len(t)}
    if isinstance(drafter, PromptDrafter):
        return {"prompt": tree}
    return {}  # a predicted output, or a drafter that is not a part of crest's


def path_length(tree: Draft, tokens: Sequence[int]) -> int:
    """Return how many leading `tokens` the tree holds as one path from its root."""
    at = -1
    for depth, token in enumerate(tokens):
        hit = np.flatnonzero((tree.parents == at) & (tree.tokens == token))  # a trie: one child per token
        if hit.size == 0:
            return depth
        at = int(hit[0])
    return len(tokens)


def tally_parts(
    counts: dict[str, int], drafter: Any, verified: Draft, *, context_length: int, accepted: Sequence[int]
) -> None:
    """Add to `counts` how many of a step's accepted draft tokens each part's tree held along the accepted path."""
    if not accepted:
        return
    try:
        for name, tree in drafted_parts(drafter, verified, context_length=context_length).items():
            counts[name] = counts.get(name, 0) + path_length(tree, accepted)
    except Exception as exc:  # a figure that cannot be counted must never fail the step
        log.debug("counting accepted tokens per part failed: %s", exc)


def request_stats(outcome: Any) -> dict[str, int]:
    """Return a finished request's figures for its learned row (`crest_client.learner.STATS`)."""
    result, parts = outcome.result, getattr(outcome, "accepted_parts", {})
    return {
        "steps": int(result.forward_passes),
        "new_tokens": len(result.output_token_ids),
        "draft_tokens": int(outcome.accepted_draft_tokens + outcome.rejected_draft_tokens),
        "accepted_tokens": int(outcome.accepted_draft_tokens),
        **{f"accepted_{name}": int(parts.get(name, 0)) for name in PARTS},
    }


def record_outcome(learner: Learner, future: Future[Any], *, max_n: int) -> None:
    """Queue a finished request's tokens and figures into its store's learner; a cancelled or failed one: nothing."""
    if future.cancelled() or future.exception() is not None:
        return
    outcome = future.result()
    if outcome.cancelled or not outcome.result.output_token_ids:
        return
    ids, prompt_tokens = served_tokens(outcome.result.prompt_token_ids, outcome.result.output_token_ids, max_n=max_n)
    learner.learn(ids, prompt_tokens=prompt_tokens, stats=request_stats(outcome))


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
