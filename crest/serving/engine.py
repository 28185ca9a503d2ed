"""The engine behind the HTTP layer: the scheduler's thread, the shared stores, and each request's drafter.

`Engine.start` runs the `Scheduler` in one background thread that owns the model; `stop` drains it. Stores are
opened once per name (`open_store`: a database that is down gives a store that drafts nothing until it answers) and
shared by every row that drafts from them, through a `StoreLease` per row so that the scheduler looks up a whole
batch in one pipeline. A store's dense part is opened once too (`open_dense`, its model checked against the served
one) and each row that drafts from it gets a `DenseLease`, so the scheduler searches the whole batch's hidden
states in one statement. A request's drafter is the registry's drafter on those leases, merged with a drafter over
the request's predicted output when it has one. With `learning`, each opened store gets a `Learner` that `submit`
feeds with the store's finished requests (with the projected hidden states of their tokens when the store has a
dense part of the served model: the live tier's dense entries), and a `Refresher` rebuilds the live tiers.
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

from crest.decoding.hidden import model_fingerprint, wants_hidden
from crest.drafters.dense import HiddenMerged
from crest.drafters.dense_index import DenseIndex, open_dense
from crest.drafters.dense_lease import DenseLease
from crest.drafters.lease import StoreLease
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.registry import check_drafter, kind_of, make_drafter, names
from crest.drafters.store import RETRY_INTERVAL, open_store
from crest.errors import ConfigError, ModelError
from crest.learning.refresher import Refresher
from crest.learning.requests import record_outcome, store_max_n
from crest.serving.learning import LearnOptions, server_source
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
    """The model's scheduler thread, the shared stores and the requests' drafters."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        *,
        model_name: str,
        store: str | None = None,
        drafter: str = "crest+prompt",
        dsn: str | None = None,
        read_dsn: str | None = None,
        fingerprint: str | None = None,
        retry_interval: float = RETRY_INTERVAL,
        learning: LearnOptions | None = None,
    ) -> None:
        self.retry_interval = retry_interval
        self.learning = learning  # None: neither record nor refresh
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        self.default_store, self.dsn, self.fingerprint = store, dsn, fingerprint
        self.read_dsn = read_dsn or dsn  # lookups (a replica); learning writes to `dsn`
        self.default_drafter = drafter if store or not kind_of(drafter).needs else "prompt"
        self._stores: dict[str, Any] = {}
        self._dense: dict[str, DenseIndex] = {}
        self._no_dense: set[str] = set()  # opened stores without a dense part of this model
        self._learners: dict[str, Learner] = {}
        self.refresher: Refresher | None = None
        if learning is not None and learning.refresh_interval > 0:
            self.refresher = Refresher(
                dsn, self.opened, interval=learning.refresh_interval, window=learning.window,
                min_new_tokens=learning.refresh_min_tokens, on_result=partial(self._observe, "observe_refresh"),
                dense_window=learning.dense_window,
            )  # fmt: skip
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread = threading.Thread(target=self._run, name="crest-scheduler", daemon=True)
        self._thread.start()
        if self.refresher is not None:
            self.refresher.start()

    def stop(self, *, timeout: float | None = None) -> None:
        """Refuse new requests, finish those in flight, stop the threads, write what was learned, close the stores."""
        self.scheduler.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.refresher is not None:
            self.refresher.stop()
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
            stores += list(self._dense.values())
            self._dense = {}
            learners, self._learners = list(self._learners.values()), {}
        for learner in learners:
            learner.close()
        for store in stores:
            try:
                store.close()
            except Exception as exc:
                log.debug("closing a store: %s", exc)

    @property
    def alive(self) -> bool:
        """Return whether the scheduler thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def store(self, name: str) -> Any:
        """Return the shared store `name`, opening it once (StoreNotFound, FingerprintMismatch, InvalidName)."""
        with self._lock:
            found = self._stores.get(name)
            if found is None:
                found = self._stores[name] = open_store(
                    name, dsn=self.read_dsn, fingerprint=self.fingerprint, retry_interval=self.retry_interval
                )
                if self._records():
                    try:
                        self._learners[name] = self._new_learner(name)
                    except Exception as exc:  # no learning for this store, drafting goes on
                        log.warning("store %r will not learn: %s", name, exc)
            return found

    def dense_index(self, name: str) -> DenseIndex:
        """Return store `name`'s shared dense part, opened once (ConfigError without one, ModelError: another model)."""
        with self._lock:
            found = self._dense.get(name)
            if found is None:
                found = open_dense(
                    name, dsn=self.read_dsn, fingerprint=self.fingerprint, retry_interval=self.retry_interval
                )
                try:
                    found.check_model(model_fingerprint(self.scheduler.gen.model))
                except BaseException:
                    found.close()
                    raise
                self._dense[name] = found
            return found

    def learn_dense(self, name: str) -> Any:
        """Return the projection (`DenseMeta`) that records store `name`'s served states, or None: no dense part."""
        with self._lock:
            if name in self._no_dense:
                return None
        try:
            return self.dense_index(name).meta  # None while its database does not answer
        except Exception as exc:  # no dense part, or another model's: the store learns its tokens only
            log.info("store %r learns no dense entries: %s", name, exc)
            with self._lock:
                self._no_dense.add(name)
            return None

    def _records(self) -> bool:
        return self.learning is not None and self.learning.record

    def opened(self) -> list[str]:
        """Return the names of the stores opened so far."""
        with self._lock:
            return list(self._stores)

    def store_stats(self) -> dict[str, dict[str, int]]:
        """Return each opened store's lookup counters (the SDK's `Store.stats`; zeros until a pending one connects)."""
        with self._lock:
            opened = dict(self._stores)
        return {name: dict(store.stats) for name, store in opened.items()}

    def learner(self, name: str) -> Learner | None:
        """Return the learner of the opened store `name`, or None (not opened, or the server does not record)."""
        with self._lock:
            return self._learners.get(name)

    def submit(self, job: Request, *, learn: bool = True) -> Future[Outcome]:
        """Queue a request (QueueFull, ShuttingDown); once finished it teaches its store when learning is on."""
        name = job.store
        learner = self.learner(name) if learn and name else None
        if learner is not None and name is not None and job.learn_dense is None:
            job.learn_dense = self.learn_dense(name)
        future = self.scheduler.submit(job)
        if learner is not None and name is not None:
            max_n = store_max_n(self._stores.get(name))
            future.add_done_callback(partial(record_outcome, learner, max_n=max_n))
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
        needs = kind_of(name).needs
        leases: list[StoreLease] = []
        if store_name is not None and ("store" in needs or self._records()):
            opened = self.store(store_name)  # also for a request that only teaches its store
            if "store" in needs:
                leases.append(StoreLease(opened))
        dense = [DenseLease(self.dense_index(store_name))] if store_name is not None and "dense_index" in needs else []
        base = None
        if name != "none":
            base = make_drafter(name, store=leases[0] if leases else None, dense_index=dense[0] if dense else None)
        if prediction:
            ids = [int(t) for t in self.tokenizer.encode(prediction, add_special_tokens=False)]
            predicted = PredictionDrafter(ids, len(prompt))
            merged = HiddenMerged if wants_hidden(base) else MergedDrafter  # hidden states reach the dense part
            base = predicted if base is None else merged(base, predicted)
        return Request(prompt, drafter=base, leases=leases, dense=dense, store=store_name, **options)

    def check_drafter(self, drafter: str | None, store: str | None) -> tuple[str, str | None]:
        """Return a request's drafter and its store (given, else the server's; None: none); ConfigError if bad."""
        requested = drafter or self.default_drafter
        served = names("serve")
        kind = kind_of(requested) if requested.strip().lower() in served else None
        if kind is None:
            raise ConfigError(f"unknown drafter {requested!r}: this server drafts with one of {', '.join(served)}")
        store_name = store or self.default_store
        if ("store" in kind.needs or "dense_index" in kind.needs) and not store_name:
            raise ConfigError(f'drafter {kind.name!r} needs a store: give "store" or start the server with --store')
        check_drafter(kind.name, where="serve", store=store_name)
        return kind.name, store_name

    def _new_learner(self, name: str) -> Learner:
        assert self.learning is not None
        return Learner(
            self.dsn, name, source=server_source(), max_pending_tokens=self.learning.max_pending_tokens,
            flush_interval=self.learning.flush_interval, on_written=partial(self._observe, "observe_learned"),
            on_dropped=partial(self._observe, "observe_learn_dropped"),
        )  # fmt: skip

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
