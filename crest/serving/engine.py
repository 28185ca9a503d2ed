"""The engine behind the HTTP layer: the scheduler's thread, the shared drafting hub, and each request's drafter.

`Engine.start` runs the `Scheduler` in one background thread that owns the model; `stop` drains it. Stores, their
dense parts, learners, recent tiers and the refresher are the `DraftHub`'s (`crest.drafting`), the one composition
root `crest serve` shares with the vLLM proposer: a request's drafter is the hub's (the registry's drafter on
per-row leases of the shared parts, so the scheduler looks up a whole batch in one pipeline and searches its hidden
states in one statement), merged with a drafter over the request's predicted output when it has one. With
`learning`, `submit` teaches each finished request to its store through the hub (with the projected hidden states
of its tokens when the store has a dense part of the served model).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from crest_client.draft import Draft
from crest_client.learner import Learner

from crest.config import DEFAULT_DRAFTER
from crest.decoding.hidden import model_fingerprint, wants_hidden
from crest.drafters.dense import HiddenMerged
from crest.drafters.dense_index import DenseIndex
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.registry import check_drafter, kind_of, names, needs_store, usable_kind
from crest.drafters.store import RETRY_INTERVAL
from crest.drafting.hub import DraftHub, LearnOptions, process_source
from crest.errors import ConfigError, ModelError
from crest.learning.requests import record_outcome
from crest.serving.scheduler import Outcome, Request, Scheduler

log = logging.getLogger(__name__)


class PredictionDrafter:
    """Drafts from a predicted output: its start before any output, else after the output's suffix within it."""

    def __init__(self, prediction: Sequence[int], prompt_length: int) -> None:
        self.prediction = [int(t) for t in prediction]
        self.prompt_length = prompt_length
        self._lookup = PromptDrafter()

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return a chain of the prediction's first tokens, or the prompt-lookup tree over prediction + output."""
        import numpy as np

        out = list(context_ids[self.prompt_length :])
        if not out:
            chain = self.prediction[:max_nodes]
            if not chain:
                return None
            n = len(chain)
            return Draft(np.array(chain), np.arange(-1, n - 1, dtype=np.int32), np.full(n, 1, dtype=np.int64))
        return self._lookup.draft(self.prediction + out, max_nodes)


class Engine:
    """The model's scheduler thread, the shared drafting hub and the requests' drafters."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        *,
        model_name: str,
        store: str | None = None,
        drafter: str = DEFAULT_DRAFTER,
        dsn: str | None = None,
        read_dsn: str | None = None,
        fingerprint: str | None = None,
        retry_interval: float = RETRY_INTERVAL,
        learning: LearnOptions | None = None,
    ) -> None:
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        self.default_store = store
        self.default_drafter = usable_kind(drafter, set() if store else {"store", "dense_index"})
        self.hub = DraftHub(
            dsn=dsn, read_dsn=read_dsn, fingerprint=fingerprint, retry_interval=retry_interval, learning=learning,
            source=process_source("serve"), model_fingerprint=lambda: model_fingerprint(scheduler.gen.model),
            on_event=self._observe,
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def learning(self) -> LearnOptions | None:
        """Return how this server learns (None: neither record nor refresh)."""
        return self.hub.learning

    @property
    def refresher(self) -> Any:
        """Return the hub's live-tier refresher (None: this server does not refresh)."""
        return self.hub.refresher

    def start(self) -> None:
        """Start the scheduler thread and the hub's threads."""
        self._thread = threading.Thread(target=self._run, name="crest-scheduler", daemon=True)
        self._thread.start()
        self.hub.start()

    def stop(self, *, timeout: float | None = None) -> None:
        """Refuse new requests, finish those in flight, stop the threads, write what was learned, close the stores."""
        self.scheduler.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.hub.close()

    @property
    def alive(self) -> bool:
        """Return whether the scheduler thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def store(self, name: str) -> Any:
        """Return the shared store `name`, opening it once (the hub's)."""
        return self.hub.store(name)

    def dense_index(self, name: str) -> DenseIndex:
        """Return store `name`'s shared dense part, opened once (the hub's)."""
        return self.hub.dense_index(name)

    def learn_dense(self, name: str) -> Any:
        """Return the projection that records store `name`'s served states, or None (the hub's)."""
        return self.hub.learn_dense(name)

    def learner(self, name: str) -> Learner | None:
        """Return the learner of the opened store `name`, or None (the hub's)."""
        return self.hub.learner(name)

    def store_stats(self) -> dict[str, dict[str, int]]:
        """Return each opened store's lookup counters (the hub's)."""
        return self.hub.store_stats()

    def submit(self, job: Request, *, learn: bool = True) -> Future[Outcome]:
        """Queue a request (QueueFull, ShuttingDown); once finished it teaches its store when learning is on."""
        name = job.store
        teaches = learn and name is not None and self.hub.records and name in self.hub.opened()
        if teaches and name is not None and job.learn_dense is None:
            job.learn_dense = self.hub.learn_dense(name)
        future = self.scheduler.submit(job)
        if teaches and name is not None:
            teach = partial(self.hub.learn, name)
            future.add_done_callback(partial(record_outcome, teach))
        return future

    def encode(self, prompt: str | list[int] | list[str]) -> list[int]:
        """Return a completion prompt's token ids (text or ids)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = str(prompt[0])
        if isinstance(prompt, str):
            return [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=False)]
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Return the chat template's token ids for (role, text) messages, with the assistant header."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError("the model's tokenizer has no chat template: use /v1/completions")
        turns = [{"role": "system" if role == "developer" else role, "content": text} for role, text in messages]
        ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def request(
        self,
        prompt: list[int],
        *,
        drafter: str | None,
        store: str | None,
        prediction: str | None,
        **options: Any,
    ) -> Request:
        """Return the scheduler request with its drafter (and store leases) for these options."""
        name, store_name = self.check_drafter(drafter, store)
        parts = self.hub.row_parts(name, store_name)
        base = parts.drafter
        if prediction:
            ids = [int(t) for t in self.tokenizer.encode(prediction, add_special_tokens=False)]
            predicted = PredictionDrafter(ids, len(prompt))
            merged = HiddenMerged if wants_hidden(base) else MergedDrafter  # hidden states reach the dense part
            base = predicted if base is None else merged(base, predicted)
        return Request(prompt, drafter=base, parts=parts.leases, store=store_name, **options)

    def check_drafter(self, drafter: str | None, store: str | None) -> tuple[str, str | None]:
        """Return a request's drafter and its store (given, else the server's; None: none); ConfigError if bad."""
        requested = drafter or self.default_drafter
        served = names("serve")
        kind = kind_of(requested) if requested.strip().lower() in served else None
        if kind is None:
            raise ConfigError(f"unknown drafter {requested!r}: this server drafts with one of {', '.join(served)}")
        store_name = store or self.default_store
        if needs_store(kind.name) and not store_name:
            raise ConfigError(
                f'drafter {kind.name!r} needs a store: give "crest_store" or start the server with --store'
            )
        check_drafter(kind.name, where="serve", store=store_name)
        return kind.name, store_name

    def _observe(self, method: str, *args: Any) -> None:
        metrics = self.scheduler.metrics  # set by the app after the stores may have been opened
        if metrics is not None:
            getattr(metrics, method)(*args)

    def _run(self) -> None:
        try:
            self.scheduler.run(self._stop)
        except BaseException:
            log.exception("the scheduler thread died")
            raise
