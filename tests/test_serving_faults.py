"""The faults a served batch meets, through the real HTTP server: a row that reaches the model's context limit, a
prompt longer than the context, the database lost in the middle of a batch, and a store dropped while it is served.

The model is a tiny random llama over the real SmolLM2 tokenizer (float64: batched and alone agree exactly), so
every greedy answer can be checked against `model.generate` of the prompt alone. A batch is formed for certain:
the scheduler's step is held until every request is queued (`held_batch`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import torch

from crest.config import IngestOptions
from crest.db.versions import drop_store
from crest.drafting.hub import LearnOptions
from crest.ingest.pipeline import ingest
from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Scheduler
from tests.fix_models import tiny_model
from tests.fix_proxy import Proxy
from tests.fix_serving import Running, flat_cost, greedy_reference, start

pytest_plugins = ["tests.fix_corpus", "tests.fix_serving"]

CONTEXT = 64  # the short model's positions
PROMPTS = ["def add(a, b):\n    return", "Hello! How can I", "The quick brown fox", "SELECT name FROM"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def short_model(smollm2_tokenizer: Any) -> Iterator[Any]:
    """A tiny random llama over the SmolLM2 vocabulary that takes CONTEXT positions, on one torch thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_model("llama", vocab=len(smollm2_tokenizer.hf), max_positions=CONTEXT, dtype=torch.float64)
    finally:
        torch.set_num_threads(before)


def held_batch(running: Running, monkeypatch: pytest.MonkeyPatch, count: int) -> Callable[..., None]:
    """Hold the scheduler's steps until `count` requests are queued (they then share the batch); return the release.

    `release()` waits for the requests, then lets the steps go; `release(wait=False)` lets them go at once (a test
    that failed before its requests were all queued).
    """
    sched, gate = running.engine.scheduler, threading.Event()
    step = sched.step
    monkeypatch.setattr(sched, "step", lambda: gate.wait() and step())

    def release(*, wait: bool = True) -> None:
        deadline = time.monotonic() + 120
        try:
            while wait and sched.queued < count:
                assert time.monotonic() < deadline, f"{sched.queued} of {count} requests queued"
                time.sleep(0.01)
        finally:
            gate.set()

    return release


def complete(
    running: Running, prompt: str | list[int], max_tokens: int, *, timeout: float = 300, **extra: Any
) -> dict[str, Any]:
    """Return the JSON answer of one greedy completion (raw HTTP: errors are answers too)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=timeout)
    return {"status": r.status_code, **r.json()}


def text_of(running: Running, ids: Sequence[int]) -> str:
    return str(running.tokenizer.decode(list(ids), skip_special_tokens=True))


def accepted(answer: dict[str, Any]) -> int:
    """Return the draft tokens crest accepted for an answer (its own count: drafts of every source)."""
    return int(answer["usage"]["crest"]["accepted_draft_tokens"])


# --- the model's context limit


def test_a_batched_row_at_the_context_limit_stops_with_length_and_the_others_go_on(
    short_model: Any, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = start(short_model, smollm2_tokenizer, None, max_batch=4)  # drafter prompt: repeats draft
    try:
        tok = running.tokenizer
        near = tok.encode("one two three one two three " * 20, add_special_tokens=False)[: CONTEXT - 9]  # 8 to go
        last = near[:1] + near[-(CONTEXT - 2) :]  # room for one token only
        short = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
        cases = [(near, 30), (last, 5), (short[0], 30), (short[1], 30)]
        release = held_batch(running, monkeypatch, len(cases))
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = pool.map(lambda case: complete(running, *case), cases)
            release()
            got = list(answers)
        for (prompt, wanted), answer in zip(cases, got, strict=True):
            assert answer["status"] == 200, answer
            n = min(wanted, CONTEXT - len(prompt))  # the context limit cuts the first two
            reference = greedy_reference(short_model, prompt, n)
            assert len(reference) == n and smollm2_tokenizer.hf.eos_token_id not in reference
            choice = answer["choices"][0]
            assert choice["text"] == text_of(running, reference), (len(prompt), wanted)
            assert answer["usage"]["completion_tokens"] == n and choice["finish_reason"] == "length"
        assert running.engine.scheduler.active == 0 and running.engine.alive
    finally:
        running.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_longer_than_the_context_is_a_400_and_leaves_no_row(
    short_model: Any, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    running = start(short_model, smollm2_tokenizer, None, max_batch=4)
    try:
        ids = running.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
        release = held_batch(running, monkeypatch, 1)
        with ThreadPoolExecutor(1) as pool:
            fine = pool.submit(complete, running, ids, 12)  # in the queue while the long prompts are refused
            try:
                for length in (CONTEXT, CONTEXT + 1, 3 * CONTEXT):
                    long = (ids * CONTEXT)[:length]
                    answer = complete(running, long, 8, stream=stream, timeout=30)  # refused, not held in the queue
                    assert answer["status"] == 400, answer
                    message = answer["error"]["message"]
                    assert f"{length} tokens" in message and f"at most {CONTEXT}" in message, message
            finally:
                release(wait=False)
            assert fine.result()["choices"][0]["text"] == text_of(running, greedy_reference(short_model, ids, 12))
        health = httpx.get(f"{running.url}/health", timeout=30).json()
        assert health == {"status": "ok", "active": 0, "queued": 0}
    finally:
        running.stop()


# --- the database


def teach(dsn: str, name: str, model: Any, tokenizer: Any, gguf: Path, root: Path, max_tokens: int) -> None:
    """Publish store `name` holding each prompt with the model's greedy answer: its drafts are accepted."""
    records = []
    for prompt in PROMPTS:
        ids = tokenizer.hf.encode(prompt, add_special_tokens=False)
        answer = tokenizer.hf.decode(greedy_reference(model, ids, max_tokens), skip_special_tokens=True)
        records += [{"text": prompt + answer}] * 3
    corpus = root / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    ingest([str(corpus)], store=name, tokenizer=str(gguf), dsn=dsn, options=IngestOptions(top_t=1000))


def wait_for_store_draft(running: Running, name: str, prompt: str, timeout: float = 60.0) -> None:
    """Wait until the server's shared store `name` drafts for the prompt (its database answers)."""
    store = running.engine.store(name)
    ids = running.tokenizer.encode(prompt, add_special_tokens=False)
    deadline = time.monotonic() + timeout
    while store.draft(ids) is None:
        assert time.monotonic() < deadline, f"store {name!r} drafts nothing: {store.stats}"
        time.sleep(0.05)


def test_the_database_lost_during_a_batch_changes_no_answer_and_drafting_resumes(
    db_dsn: str,
    tiny_served: Any,
    smollm2_tokenizer: Any,
    smollm2_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    teach(db_dsn, "code", tiny_served, smollm2_tokenizer, smollm2_gguf, tmp_path, MAX_TOKENS)
    monkeypatch.setenv("CREST_LOOKUP_TIMEOUT", "1.0")  # a loaded machine must not turn lookups into misses
    proxy, proxied = Proxy.fronting(db_dsn)
    proxy.up()
    running = start(tiny_served, smollm2_tokenizer, proxied, store="code", max_batch=len(PROMPTS))
    try:
        wait_for_store_draft(running, "code", PROMPTS[0])
        tok = running.tokenizer
        want = [text_of(running, running.reference(tok.encode(p, add_special_tokens=False), MAX_TOKENS))
                for p in PROMPTS]  # fmt: skip
        sched, store = running.engine.scheduler, running.engine.store("code")
        release = held_batch(running, monkeypatch, len(PROMPTS))
        held = sched.step
        after: list[int] = []  # rows in the batch at each step once the database is gone

        def cut_after_first() -> bool:
            worked = held()
            if worked and not after and proxy.listener is not None:
                proxy.down()  # every connection cut, new ones refused: in the middle of the batch's decoding
            elif worked:
                after.append(sched.active)
            return worked

        monkeypatch.setattr(sched, "step", cut_after_first)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = pool.map(lambda p: complete(running, p, MAX_TOKENS, drafter="crest"), PROMPTS)
            release()
            down = list(answers)
        assert [a["status"] for a in down] == [200] * len(PROMPTS), down
        assert [a["choices"][0]["text"] for a in down] == want
        assert after and after[0] == len(PROMPTS), after  # the whole batch decoded on without its database
        assert sum(accepted(a) for a in down) > 0  # the first step's store drafts were accepted
        assert store.stats["errors"] + store.stats["timeouts"] > 0, store.stats  # the lookups after it failed

        proxy.up()
        wait_for_store_draft(running, "code", PROMPTS[0])  # the same shared store reconnects
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            back = list(pool.map(lambda p: complete(running, p, MAX_TOKENS, drafter="crest"), PROMPTS))
        assert [a["choices"][0]["text"] for a in back] == want
        assert all(accepted(a) > 0 for a in back), [a["usage"] for a in back]  # every request drafts again
    finally:
        running.stop()
        proxy.down()


def test_a_store_dropped_while_served_drafts_nothing_and_fails_no_request(
    db_dsn: str,
    tiny_served: Any,
    smollm2_tokenizer: Any,
    smollm2_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    teach(db_dsn, "code", tiny_served, smollm2_tokenizer, smollm2_gguf, tmp_path, MAX_TOKENS)
    monkeypatch.setenv("CREST_LOOKUP_TIMEOUT", "1.0")
    sched = Scheduler(tiny_served, smollm2_tokenizer.hf, cost=flat_cost(), max_batch=len(PROMPTS))
    # learning and refreshing as `crest serve` does (no recent tier: every draft is the database's)
    learning = LearnOptions(refresh_interval=0.1, refresh_min_tokens=0, flush_interval=0.05, recent=None)
    engine = Engine(sched, smollm2_tokenizer.hf, model_name="tiny", store="code", drafter="crest", dsn=db_dsn,
                    fingerprint=smollm2_tokenizer.fingerprint, learning=learning)  # fmt: skip
    running = Running(create_app(engine), engine, tiny_served, smollm2_tokenizer.hf)
    try:
        tok = running.tokenizer
        want = [text_of(running, running.reference(tok.encode(p, add_special_tokens=False), MAX_TOKENS))
                for p in PROMPTS]  # fmt: skip
        first = complete(running, PROMPTS[0], MAX_TOKENS)
        assert first["choices"][0]["text"] == want[0] and accepted(first) > 0  # the store drafts
        release = held_batch(running, monkeypatch, len(PROMPTS))
        held, dropped = sched.step, threading.Event()

        def drop_after_first() -> bool:
            worked = held()
            if worked and not dropped.is_set():
                with psycopg.connect(db_dsn) as conn:  # `crest drop` while the batch decodes
                    drop_store(conn, "code")
                dropped.set()
            return worked

        monkeypatch.setattr(sched, "step", drop_after_first)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = pool.map(lambda p: complete(running, p, MAX_TOKENS), PROMPTS)
            release()
            during = list(answers)
        assert [a["status"] for a in during] == [200] * len(PROMPTS), during
        assert [a["choices"][0]["text"] for a in during] == want
        refresher = engine.refresher
        assert refresher is not None
        failed = refresher.counts["failed"] + refresher.counts["nothing"]
        deadline = time.monotonic() + 60
        while refresher.counts["failed"] + refresher.counts["nothing"] <= failed:  # it refreshed the dropped store
            assert time.monotonic() < deadline, refresher.counts
            time.sleep(0.02)
        after = [complete(running, p, MAX_TOKENS) for p in PROMPTS]  # the dropped store is still the default
        assert [a["status"] for a in after] == [200] * len(PROMPTS), after
        assert [a["choices"][0]["text"] for a in after] == want
        assert all(accepted(a) == 0 for a in after), [a["usage"] for a in after]  # nothing drafts from it
        assert httpx.get(f"{running.url}/health", timeout=30).json()["status"] == "ok"
    finally:
        running.stop()
