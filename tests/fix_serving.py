"""A served model for the tests: `Running` serves an app with uvicorn in a thread on a free port, `start` builds a
Scheduler and Engine around a model and serves them, `tiny_served` (a fixture) is a tiny random llama over the
SmolLM2 vocabulary, `flat_cost` a cost model where every draft size costs the same, and `drive` steps a
Scheduler without HTTP until its requests finish. Load it as a plugin (`pytest_plugins`) for the fixture.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import openai
import pytest
import torch
import uvicorn

from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Outcome, Request, Scheduler
from tests.fix_models import tiny_model


def greedy_reference(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Return `model.generate`'s greedy output for the prompt alone."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return [int(t) for t in out[0, len(prompt_ids) :]]


class Running:
    """A server running in a thread: its base URL, engine and model."""

    def __init__(self, app: Any, engine: Engine, model: Any, tokenizer: Any) -> None:
        self.engine, self.model, self.tokenizer = engine, model, tokenizer
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def reference(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Return `model.generate`'s greedy output for the prompt alone."""
        return greedy_reference(self.model, prompt_ids, max_tokens)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def tiny_served(smollm2_tokenizer: Any) -> Iterator[Any]:
    """A tiny random llama over the SmolLM2 vocabulary, served on one torch thread (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_model("llama", vocab=len(smollm2_tokenizer.hf), max_positions=2048, dtype=torch.float64)
    finally:
        torch.set_num_threads(before)


def start(model: Any, tokenizer: Any, dsn: str | None, *, store: str | None = None, **kw: Any) -> Running:
    """Serve `model` with a Scheduler (kw: its options, `api_key`, `cost`) and an Engine drafting from `store`."""
    api_key = kw.pop("api_key", None)
    sched = Scheduler(model, tokenizer.hf, cost=kw.pop("cost", None) or flat_cost(), **kw)
    engine = Engine(
        sched, tokenizer.hf, model_name="tiny", store=store, drafter="crest+prompt" if store else "prompt", dsn=dsn,
        fingerprint=tokenizer.fingerprint,
    )  # fmt: skip
    return Running(create_app(engine, api_key=api_key), engine, model, tokenizer.hf)


def flat_cost() -> Any:
    """Return a cost model where a step costs the same whatever the draft size (drafting always pays)."""
    from crest.decoding.sizing import CostModel

    return CostModel([1, 64], [1.0, 1.0])


def drive(sched: Scheduler, joins: Sequence[tuple[int, Request]], *, limit: int = 1000) -> list[Outcome]:
    """Submit each request at its step, step until all are done; return their outcomes in order."""
    futures: list[Any] = [None] * len(joins)
    for step in range(limit):
        for i, (at, request) in enumerate(joins):
            if at == step:
                futures[i] = sched.submit(request)
        worked = sched.step()
        if not worked and all(f is not None and f.done() for f in futures):
            return [f.result() for f in futures]
    raise AssertionError("the scheduler did not finish")
