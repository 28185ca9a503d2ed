"""A request's row in the scheduler's batch, and its hidden states: fed to its drafter, kept, recorded.

A row whose drafter queries with hidden states gets the state that predicted its last token, and its dense
lookups go as one ANN statement per dense index; a row recording for its store's live dense part keeps the
projected state behind each token it emits, gathered with the others in one call and projected once per store.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crest.decoding.generator import DecodeState
from crest.decoding.hidden import feed_hidden
from crest.serving.request import Outcome, Request


@dataclass
class Row:
    """A request in the batch: its request, decode state, future and draft counters."""

    request: Request
    state: DecodeState
    future: Future[Outcome]
    accepted: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # accepted tokens per drafter part (`tally_parts`)
    dense: list[np.ndarray] = field(default_factory=list)  # [k, D] float16 projected states, one block a step
    dense_from: int = 0


class NoCache:
    """The per-request cache slot of a batched row: its KV entries live in the `BatchCache`."""

    layers: tuple[Any, ...] = ()


def keep_hidden_states(rows: list[Row], accepted: list[list[int]]) -> None:
    """Keep each hidden-state row's state at its last accepted slot (root: 0): it predicted the token after.

    A row that records its states (`Request.learn_dense`) gets those of the root and of every accepted slot
    (each predicted one emitted token), projected, in the same gather.
    """
    tapped = [r for r, row in enumerate(rows) if row.state.tap is not None]
    if not tapped:
        return
    pairs: list[tuple[int, int]] = []  # (batch row, slot) to gather
    ends: list[int] = []  # per tapped row: one past its last pair
    for r in tapped:
        slots = [0, *accepted[r]] if rows[r].request.learn_dense is not None else accepted[r][-1:] or [0]
        pairs.extend((r, slot) for slot in slots)
        ends.append(len(pairs))
    found = rows[tapped[0]].state.tap.rows([r for r, _ in pairs], [slot for _, slot in pairs])  # [P, H]
    recording: dict[int, list[tuple[Row, int, int]]] = {}  # per projection: its rows and their states
    for r, start, end in zip(tapped, [0, *ends[:-1]], ends, strict=True):
        row = rows[r]
        row.state.hidden = found[end - 1] if found is not None else None
        if found is not None and row.request.learn_dense is not None:
            recording.setdefault(id(row.request.learn_dense), []).append((row, start, end))
    for group in recording.values():  # one projection for all rows of a store
        picked = np.concatenate([np.arange(start, end) for _, start, end in group])
        projected = project_states(group[0][0].request.learn_dense, found[picked])  # [p, D]
        at = 0
        for row, start, end in group:
            row.dense.append(projected[at : at + end - start])
            at += end - start


def feed_hidden_states(rows: list[Row]) -> None:
    """Hand each hidden-state row's drafter the state that predicted its last token (None: unknown)."""
    for row in rows:
        if row.state.tap is not None:
            feed_hidden(row.request.drafter, len(row.state.context), row.state.hidden)


def record_prefill(row: Row) -> None:
    """Start a recording row's states with its prefill state (it predicted the prompt's last token)."""
    state, meta = row.state, row.request.learn_dense
    if meta is None:
        return
    row.dense_from = len(state.prompt)
    if state.hidden is not None:
        row.dense.append(project_states(meta, state.hidden[None, :]))
        row.dense_from -= 1


def project_states(meta: Any, hidden: np.ndarray) -> np.ndarray:
    """Return hidden states [k, H] projected by a dense part (standardise, PCA, normalise) as float16 [k, D]."""
    return np.asarray(meta.project(hidden), dtype=np.float16)
