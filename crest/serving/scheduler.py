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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft, empty_draft

from crest.decoding.generator import DecodeState, SpeculativeGenerator
from crest.decoding.hidden import bind_drafter, model_tap, wants_hidden
from crest.decoding.sampling import accept_greedy, children_of
from crest.decoding.sizing import CostModel
from crest.drafters.parts import BatchRow, prefetch_parts
from crest.errors import CrestError
from crest.learning.requests import tally_parts
from crest.serving._rows import NoCache, Row, feed_hidden_states, keep_hidden_states, record_prefill
from crest.serving.batch import BatchCache, TreeRow
from crest.serving.request import Outcome, QueueFull, Request, ShuttingDown

__all__ = ["Outcome", "QueueFull", "Request", "Scheduler", "ShuttingDown"]

log = logging.getLogger(__name__)


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
        self._inbox: queue.Queue[Row] = queue.Queue()
        self._waiting: deque[Row] = deque()
        self._rows: list[Row] = []
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
        row = Row(request, state, Future())
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
                row.state.cache = NoCache()
                if row.state.tap is not None and len(row.state.prompt) > 1:  # else no forward ran: unknown
                    row.state.hidden = row.state.tap.row(-1)
                record_prefill(row)
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
        keep_hidden_states(self._rows, accepted)
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
        feed_hidden_states(rows)
        # every row's part views looked up for the batch: a store's in one round trip, a dense part's in one search
        # (a row with no room left or no state this step is not searched)
        prefetch_parts(
            [(row.request.parts, BatchRow(row.state.context, _query(row, self.gen.room))) for row in rows],
            max_nodes=self.budget,
        )
        drafts = [
            self.policy.draft(row.request.drafter, row.state.context, room=self.gen.room(row.state)) for row in rows
        ]
        return self.policy.size(drafts)

    def _remove(self, indices: list[int]) -> None:
        if not indices:
            return
        self.batch.remove(indices)
        gone = set(indices)
        self._rows = [row for i, row in enumerate(self._rows) if i not in gone]

    def _finish(self, row: Row, *, cancelled: bool = False) -> None:
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

    def _fail(self, row: Row, exc: BaseException) -> None:
        if not isinstance(exc, CrestError):
            log.warning("request failed: %s: %s", type(exc).__name__, exc)
        if not row.future.done():
            row.future.set_exception(exc)

    def _report_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_queue(queued=self._queued, active=len(self._rows))


def _query(row: Row, room: Callable[[DecodeState], int]) -> np.ndarray | None:
    """Return the hidden state a row's dense part is searched with this step (None: none, or no room to draft)."""
    state = row.state
    return state.hidden if state.tap is not None and state.hidden is not None and room(state) > 0 else None
