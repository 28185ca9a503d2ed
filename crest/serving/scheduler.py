"""Continuous batching: a plain class whose `step()` admits requests, drafts, verifies every row in one forward.

`Scheduler.submit` checks a request (in the caller's thread: bad options raise at once) and queues it, returning a
`concurrent.futures.Future` of its `Outcome`; text streams through the request's `on_text` as it is accepted. Each
`step()` admits waiting requests up to `max_batch` (each prefilled alone and merged into the `BatchCache`), drops
cancelled rows, drafts for all rows (stores looked up in one pipeline per store; rows whose drafter queries with
hidden states get the one that predicted their last token, and their dense lookups go as one ANN statement per
dense index; a row recording for its store's live dense part keeps the projected state behind each token it
emits, from the same gather), sizes the drafts for the batch, runs one target forward, accepts per row exactly as
`SpeculativeGenerator` does (its own `accept` and `commit` steps: greedy argmax, or the row's own seeded generator)
and finishes rows that stopped. One row's failure fails that request only. `run()` loops `step()` in the thread
that owns the model; `close()` drains. Tests drive `step()` directly.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft, empty_draft

from crest.decoding.drafter import Drafter
from crest.decoding.generator import DecodeState, GenerationResult, SpeculativeGenerator
from crest.decoding.hidden import bind_drafter, feed_hidden, model_tap, wants_hidden
from crest.decoding.sampling import accept_greedy, children_of
from crest.decoding.sizing import CostModel
from crest.drafters.dense_lease import DenseLease, prefetch_dense
from crest.drafters.lease import StoreLease, prefetch
from crest.errors import CrestError
from crest.learning.requests import tally_parts
from crest.serving.batch import BatchCache, TreeRow

log = logging.getLogger(__name__)


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
    leases: Sequence[StoreLease] = ()  # the store views inside `drafter`, filled once per step for the batch
    dense: Sequence[DenseLease] = ()  # the dense-index views inside `drafter`, searched once per step for the batch
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


@dataclass
class _Row:
    """A request in the batch: its request, decode state, future and draft counters."""

    request: Request
    state: DecodeState
    future: Future[Outcome]
    accepted: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # accepted tokens per drafter part (`tally_parts`)
    dense: list[np.ndarray] = field(default_factory=list)  # [k, D] float16 projected states, one block a step
    dense_from: int = 0


class _NoCache:
    """The per-request cache slot of a batched row: its KV entries live in the `BatchCache`."""

    layers: tuple[Any, ...] = ()


class Scheduler:
    """Serves many requests with one model: continuous batching with per-row tree verification."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_draft_tokens: int | None = None,
        draft_budget: int = 64,
        cost: CostModel | None = None,
        metrics: Any = None,
    ) -> None:
        if max_batch < 1 or max_queue < 0:
            raise CrestError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.gen = SpeculativeGenerator(
            model, tokenizer, max_draft_tokens=max_draft_tokens, draft_budget=draft_budget, cost=cost
        )
        self.policy = self.gen.policy  # the generator's drafting policy, applied to the whole batch
        self.batch = BatchCache(model)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.budget = self.policy.budget
        self.metrics = metrics
        self._inbox: queue.Queue[_Row] = queue.Queue()
        self._waiting: deque[_Row] = deque()
        self._rows: list[_Row] = []
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted
        self._wake = threading.Event()
        self._closing = False
        self._ids = itertools.count()
        self._observe_costs = cost is None  # a given cost model is taken as it is (tests pin the sizes with one)

    @property
    def active(self) -> int:
        """Return the number of rows in the batch."""
        return len(self._rows)

    @property
    def queued(self) -> int:
        """Return the number of requests waiting for a row."""
        return self._queued

    @property
    def acceptance_scale(self) -> float:
        """Return the observed ratio of accepted to weight-predicted draft nodes (0.5 before any step)."""
        return self.policy.acceptance_scale

    def submit(self, request: Request) -> Future[Outcome]:
        """Check and queue a request; raise ConfigError/ModelError on bad input, QueueFull, or ShuttingDown."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        state = self.gen.start(
            request.prompt,
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=request.stop,
            on_text=request.on_text,
        )
        bind_drafter(self.gen.model, request.drafter)  # a dense part of another model: ModelError now
        with self._lock:
            if self._queued >= self.max_queue + max(0, self.max_batch - len(self._rows)):
                raise QueueFull(f"{self._queued} requests are waiting (--max-queue {self.max_queue})")
            self._queued += 1
        row = _Row(request, state, Future())
        row.future.set_running_or_notify_cancel()
        self._inbox.put(row)
        self._wake.set()
        return row.future

    def step(self) -> bool:
        """Admit, draft, verify and accept one step for every row; return whether any work was done."""
        self._admit()
        self._drop_cancelled()
        self._report_depth()
        if not self._rows:
            return False
        with torch.no_grad():
            self._decode()
        return True

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set and nothing is left (the drain); sleep while idle."""
        while True:
            try:
                worked = self.step()
            except Exception as exc:  # a scheduler bug fails the requests in flight, never the server
                log.exception("scheduler step failed; failing the requests in flight")
                self._reset(exc)
                worked = True
            if stop.is_set() and not self._rows and not self._waiting and self._inbox.empty():
                return
            if not worked:
                self._wake.wait(0.05)
                self._wake.clear()

    def close(self) -> None:
        """Refuse new requests from now on (`run` then drains what is in flight)."""
        self._closing = True
        self._wake.set()

    def _reset(self, exc: BaseException) -> None:
        """Fail every row in the batch and start from an empty batch cache."""
        for row in self._rows:
            self._fail(row, exc)
        self._rows = []
        self.batch = BatchCache(self.gen.model)

    def _admit(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        while self._waiting and len(self._rows) < self.max_batch:
            row = self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            if row.request.cancelled.is_set():
                self._finish(row, cancelled=True)
                continue
            try:
                row.state.started = time.perf_counter()
                if wants_hidden(row.request.drafter) or row.request.learn_dense is not None:
                    row.state.tap = model_tap(self.gen.model)  # hooked here, in the thread that runs the model
                self.batch.prefill(row.state.prompt)
                row.state.prefill_seconds = time.perf_counter() - row.state.started
                row.state.cache = _NoCache()
                if row.state.tap is not None and len(row.state.prompt) > 1:  # else no forward ran: unknown
                    row.state.hidden = row.state.tap.row(-1)
                self._record_prefill(row)
            except Exception as exc:
                self._fail(row, exc)
                continue
            self._rows.append(row)

    def _drop_cancelled(self) -> None:
        gone = [i for i, row in enumerate(self._rows) if row.request.cancelled.is_set()]
        for i in gone:
            self._finish(self._rows[i], cancelled=True)
        self._remove(gone)

    def _decode(self) -> None:
        t0 = time.perf_counter()
        drafts, predicted = self._draft()
        t1 = time.perf_counter()
        trees = [TreeRow(row.state.context[-1], draft) for row, draft in zip(self._rows, drafts, strict=True)]
        try:
            logits, tokens, parents = self.batch.forward(trees)  # [B, S, V]
        except Exception as exc:  # a failed forward fails the batch's requests, never the server
            log.error("batched forward failed: %s", exc)
            for row in self._rows:
                self._fail(row, exc)
            self._remove(list(range(len(self._rows))))
            return
        greedy = logits.argmax(dim=-1).tolist()  # [B, S]: one host sync for all greedy rows
        accepted: list[list[int]] = []
        emitted: list[list[int]] = []
        for r, row in enumerate(self._rows):
            kids = children_of(parents[r], tokens[r])
            if row.state.temperature > 0:
                slots, new = self.gen.accept(row.state, logits[r, : len(tokens[r])], kids)
            else:
                slots, new = accept_greedy(greedy[r], kids)
            accepted.append(slots)
            emitted.append(new)
            if slots:  # the context is still the one the row drafted for
                tally_parts(row.parts, row.request.drafter, drafts[r], context_length=len(row.state.context),
                            accepted=new[: len(slots)])  # fmt: skip
        self._keep_hidden(accepted)
        self.batch.commit(accepted)
        if self._observe_costs:
            self.policy.observe_cost(logits.shape[0] * logits.shape[1], time.perf_counter() - t1)
        if any(len(d) for d in drafts):
            self.policy.observe(accepted=sum(len(a) for a in accepted), predicted=predicted)
        seconds = time.perf_counter() - t1
        done: list[int] = []
        for r, row in enumerate(self._rows):
            state = row.state
            state.draft_seconds += t1 - t0
            state.verify_seconds += seconds
            state.draft_tokens += len(drafts[r])
            row.accepted += len(accepted[r])
            try:
                self.gen.commit(state, emitted[r], accepted[r])
            except Exception as exc:  # a tokenizer or stop-string failure ends this request only
                self._fail(row, exc)
                done.append(r)
                continue
            if state.done:
                self._finish(row)
                done.append(r)
        if self.metrics is not None:
            self.metrics.observe_step(rows=len(self._rows), accepted=[len(a) for a in accepted], draft_seconds=t1 - t0)
        self._remove(done)

    def _draft(self) -> tuple[list[Draft], float]:
        """Return each row's draft, cut to its room and sized for the batch, and the expected accepted nodes."""
        rows = self._rows
        if self.budget <= 0 or self.policy.skip(len(rows)):
            # nothing to draft, or drafting did not pay on the last tries at this batch size: spare the drafters
            return [empty_draft() for _ in rows], 0.0
        leases = [(lease, row.state.context) for row in rows for lease in row.request.leases]
        if leases:
            prefetch([lease for lease, _ in leases], [ctx for _, ctx in leases], max_nodes=self.budget)
        self._feed_hidden()
        drafts = [
            self.policy.draft(row.request.drafter, row.state.context, room=self.gen.room(row.state)) for row in rows
        ]
        return self.policy.size(drafts)

    def _keep_hidden(self, accepted: list[list[int]]) -> None:
        """Keep each hidden-state row's state at its last accepted slot (root: 0): it predicted the token after.

        A row that records its states (`Request.learn_dense`) gets those of the root and of every accepted slot
        (each predicted one emitted token), projected, in the same gather.
        """
        rows = [r for r, row in enumerate(self._rows) if row.state.tap is not None]
        if not rows:
            return
        pairs: list[tuple[int, int]] = []  # (batch row, slot) to gather
        ends: list[int] = []  # per tapped row: one past its last pair
        for r in rows:
            slots = [0, *accepted[r]] if self._rows[r].request.learn_dense is not None else accepted[r][-1:] or [0]
            pairs.extend((r, slot) for slot in slots)
            ends.append(len(pairs))
        found = self._rows[rows[0]].state.tap.rows([r for r, _ in pairs], [slot for _, slot in pairs])  # [P, H]
        recording: dict[int, list[tuple[_Row, int, int]]] = {}  # per projection: its rows and their states
        for r, start, end in zip(rows, [0, *ends[:-1]], ends, strict=True):
            row = self._rows[r]
            row.state.hidden = found[end - 1] if found is not None else None
            if found is not None and row.request.learn_dense is not None:
                recording.setdefault(id(row.request.learn_dense), []).append((row, start, end))
        for group in recording.values():  # one projection for all rows of a store
            picked = np.concatenate([np.arange(start, end) for _, start, end in group])
            projected = _projected(group[0][0].request.learn_dense, found[picked])  # [p, D]
            at = 0
            for row, start, end in group:
                row.dense.append(projected[at : at + end - start])
                at += end - start

    def _feed_hidden(self) -> None:
        """Hand each hidden-state row's drafter its state; search all rows' dense leases, one statement per index."""
        leases: list[DenseLease] = []
        states: list[Any] = []
        for row in self._rows:
            state = row.state
            if state.tap is None:
                continue
            feed_hidden(row.request.drafter, len(state.context), state.hidden)
            if state.hidden is not None and self.gen.room(state) > 0:
                leases.extend(row.request.dense)
                states.extend([state.hidden] * len(row.request.dense))
        if leases:
            prefetch_dense(leases, states)

    def _record_prefill(self, row: _Row) -> None:
        """Start a recording row's states with its prefill state (it predicted the prompt's last token)."""
        state, meta = row.state, row.request.learn_dense
        if meta is None:
            return
        row.dense_from = len(state.prompt)
        if state.hidden is not None:
            row.dense.append(_projected(meta, state.hidden[None, :]))
            row.dense_from -= 1

    def _remove(self, indices: list[int]) -> None:
        if not indices:
            return
        self.batch.remove(indices)
        gone = set(indices)
        self._rows = [row for i, row in enumerate(self._rows) if i not in gone]

    def _finish(self, row: _Row, *, cancelled: bool = False) -> None:
        state = row.state
        if not state.seconds and state.started:
            state.seconds = time.perf_counter() - state.started
        try:
            result = self.gen.finish(state)
        except Exception as exc:
            self._fail(row, exc)
            return
        outcome = Outcome(result, row.accepted, state.draft_tokens - row.accepted, cancelled, dict(row.parts))
        if row.dense:
            outcome.dense, outcome.dense_from = np.concatenate(row.dense), row.dense_from
            outcome.dense_version = int(row.request.learn_dense.store_id)
        if self.metrics is not None:
            self.metrics.observe_done(outcome)
        row.future.set_result(outcome)

    def _fail(self, row: _Row, exc: BaseException) -> None:
        if not isinstance(exc, CrestError):
            log.warning("request failed: %s: %s", type(exc).__name__, exc)
        if not row.future.done():
            row.future.set_exception(exc)

    def _report_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_queue(queued=self._queued, active=len(self._rows))


def _projected(meta: Any, hidden: np.ndarray) -> np.ndarray:
    """Return hidden states [k, H] projected by a dense part (standardise, PCA, normalise) as float16 [k, D]."""
    return np.asarray(meta.project(hidden), dtype=np.float16)
