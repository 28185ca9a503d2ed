"""Learning in the server: how it learns (`LearnOptions`) and the source its learned rows carry.

A finished request (not cancelled, not failed) whose store the server has opened teaches that store what
`crest.learning.requests` says it teaches, through the store's `crest_client.learner.Learner`; a
`crest.learning.refresher.Refresher` rebuilds the live tiers of the opened stores every `refresh_interval`
seconds, so what any server on the database learned becomes every server's live drafts. Learning changes drafts
only, never the output: verification keeps it exact.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from crest.config import (
    DEFAULT_LEARN_DENSE_WINDOW,
    DEFAULT_LEARN_WINDOW,
    DEFAULT_REFRESH_INTERVAL,
    DEFAULT_REFRESH_MIN_TOKENS,
)


@dataclass(frozen=True)
class LearnOptions:
    """How a server learns: record finished requests, and refresh the live tiers of its stores now and then."""

    record: bool = True  # write each finished request's tokens (--learn); per request: the `learn` field
    window: int = DEFAULT_LEARN_WINDOW  # a refresh builds the live tier from the last `window` learned tokens
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL  # 0: this server never refreshes
    refresh_min_tokens: int = DEFAULT_REFRESH_MIN_TOKENS
    max_pending_tokens: int = 1_000_000  # per store: tokens waiting to be written, beyond which the oldest go
    flush_interval: float = 1.0  # seconds between the learners' writes
    dense_window: int = DEFAULT_LEARN_DENSE_WINDOW  # recorded hidden states a live dense part holds (0: none)


def server_source() -> str:
    """Return this server's id for the `source` of the rows it writes (host and process)."""
    return f"serve@{socket.gethostname()}:{os.getpid()}"
