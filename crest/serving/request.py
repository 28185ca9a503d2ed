"""What the scheduler takes and gives back: a `Request`, its `Outcome`, and the errors `submit` raises when full.

A request carries its prompt ids, sampling options, its drafter with the store and dense-index views inside it
(filled once per step for the whole batch), the store it belongs to and the callbacks that stream its text; an
outcome carries the generation result, the draft tokens accepted and rejected, per part, and the projected
hidden states recorded for the store's live dense part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crest.decoding.drafter import Drafter
from crest.decoding.generator import GenerationResult
from crest.errors import CrestError


class QueueFull(CrestError):
    """The server's queue of waiting requests is full: retry later."""


class ShuttingDown(CrestError):
    """The server is draining and takes no new requests."""


@dataclass
class Request:
    """One completion request for the scheduler: prompt ids, sampling options, its drafter and callbacks."""

    prompt: list[int]
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    drafter: Drafter | None = None
    # the part views inside `drafter` by part name (a store's, its dense part's), looked up once per step for the
    # batch (`crest.drafters.parts.prefetch_parts`)
    parts: Mapping[str, Any] = field(default_factory=dict)
    store: str | None = None  # the store the request belongs to: it drafts from it and, learning, teaches it
    learn_dense: Any = None  # a `DenseMeta`: project the states of its tokens for the store's live dense part
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    """A finished request: its generation result and how many draft tokens were accepted and rejected."""

    result: GenerationResult
    accepted_draft_tokens: int
    rejected_draft_tokens: int
    cancelled: bool = False
    accepted_parts: dict[str, int] = field(default_factory=dict)  # accepted tokens each part's tree held
    dense: np.ndarray | None = None  # [n, D] float16 projected states (`Request.learn_dense`), None: not recorded
    dense_from: int = 0  # index in prompt + output of the token the first of them predicted
    dense_version: int | None = None  # the static store version whose dense part projected them
