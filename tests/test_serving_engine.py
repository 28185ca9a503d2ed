"""Mixed tenants through the real HTTP server: two real stores x drafters {none, prompt, crest, crest+prompt} x
{greedy, seeded}, all sent at once, each answer equal to the same request sent alone (and greedy ones to
`model.generate`); every learned row goes to the store its request named; and the rows of one store share one
round trip per step (the real `crest_client.Store`, not a stand-in, behind the prefetch).

The model is a tiny random llama over the real SmolLM2 tokenizer, as in tests/test_serving_http.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from crest.config import IngestOptions
from crest.drafting.hub import LearnOptions
from crest.ingest.pipeline import ingest
from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Scheduler
from tests.fix_serving import Running, flat_cost, greedy_reference

pytest_plugins = ["tests.fix_corpus", "tests.fix_serving"]

CORPORA = {
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20,
    "chat": "Hello! How can I help you today? I can help you with that. Thank you for asking.\n" * 20,
}
PROMPTS = {"code": "def add(a, b):\n    return", "chat": "Hello! How can I"}
DRAFTERS = ["none", "prompt", "crest", "crest+prompt"]
CASES = [(store, drafter, seed) for store in CORPORA for drafter in DRAFTERS for seed in (None, 7)]
MAX_TOKENS = 16


@pytest.fixture
def tenants(
    db_dsn: str, tiny_served: Any, smollm2_tokenizer: Any, smollm2_gguf: Path, tmp_path: Path
) -> Iterator[Running]:
    """A learning server (refreshing only when told) over two real stores, `code` (its default) and `chat`."""
    for name, text in CORPORA.items():  # each store also holds the model's own greedy answer: its drafts pay
        ids = smollm2_tokenizer.hf.encode(PROMPTS[name], add_special_tokens=False)
        answer = smollm2_tokenizer.hf.decode(greedy_reference(tiny_served, ids, MAX_TOKENS), skip_special_tokens=True)
        corpus = tmp_path / f"{name}.jsonl"
        records = [{"text": text}, *[{"text": PROMPTS[name] + answer}] * 3]
        corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        ingest([str(corpus)], store=name, tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    sched = Scheduler(tiny_served, smollm2_tokenizer.hf, cost=flat_cost(), max_batch=8)
    # no recent tier: a seeded row draws as many numbers as its trees have nodes, so "alone" must draft as "together"
    learning = LearnOptions(refresh_interval=3600, refresh_min_tokens=0, flush_interval=0.05, recent=None)
    engine = Engine(sched, smollm2_tokenizer.hf, model_name="tiny", store="code", drafter="crest+prompt", dsn=db_dsn,
                    fingerprint=smollm2_tokenizer.fingerprint, learning=learning)  # fmt: skip
    running = Running(create_app(engine), engine, tiny_served, smollm2_tokenizer.hf)
    yield running
    running.stop()


def ask(running: Running, store: str, drafter: str, seed: int | None) -> tuple[str, int]:
    """Return the text and accepted draft tokens of one completion of the store's prompt."""
    sampling: dict[str, Any] = {"temperature": 0.8, "seed": seed} if seed is not None else {"temperature": 0}
    reply = running.client().completions.create(
        model="tiny", prompt=PROMPTS[store], max_tokens=MAX_TOKENS, extra_body={"store": store, "drafter": drafter},
        **sampling,
    )  # fmt: skip
    own = (reply.usage.model_extra or {}).get("crest", {}) if reply.usage else {}
    return reply.choices[0].text, int(own.get("accepted_draft_tokens", 0))  # crest's own count: drafts of every source


def learned_prompts(dsn: str) -> dict[str, list[list[int]]]:
    """Return each store's learned rows' prompt tokens (the prompt's tail a row keeps before the output)."""
    found: dict[str, list[list[int]]] = {}
    with psycopg.connect(dsn) as conn:
        for store, tokens, kept in conn.execute("SELECT store, tokens, prompt_tokens FROM crest_learned ORDER BY id"):
            found.setdefault(store, []).append(np.frombuffer(tokens, dtype="<u4").tolist()[:kept])
    return found


def test_mixed_tenants_at_once_equal_each_alone_and_learn_into_their_store(
    tenants: Running, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: dict[str, list[int]] = {name: [] for name in CORPORA}  # contexts per round trip, per store
    for name in CORPORA:  # the real store answers; the spy only notes how many contexts each call carries
        store = tenants.engine.store(name)

        def spy(contexts: Any, *args: Any, _real: Any = store.draft_many_parts, _name: str = name, **kw: Any) -> Any:
            batches[_name].append(len(contexts))
            return _real(contexts, *args, **kw)

        monkeypatch.setattr(store, "draft_many_parts", spy)
    sched, gate = tenants.engine.scheduler, threading.Event()
    step = sched.step
    monkeypatch.setattr(sched, "step", lambda: gate.wait() and step())  # held until every request is queued
    with ThreadPoolExecutor(len(CASES)) as pool:  # every case at once: rows of both stores share the batch
        replies = pool.map(lambda case: ask(tenants, *case), CASES)
        deadline = time.monotonic() + 120
        while sched.queued < len(CASES):
            assert time.monotonic() < deadline, f"{sched.queued} of {len(CASES)} requests queued"
            time.sleep(0.01)
        gate.set()
        together = list(replies)
    grouped = {name: max(sizes, default=0) for name, sizes in batches.items()}
    for case, (text, _) in zip(CASES, together, strict=True):
        assert text == ask(tenants, *case)[0], case  # the same request alone
    for store, prompt in PROMPTS.items():
        ids = tenants.tokenizer.encode(prompt, add_special_tokens=False)
        want = tenants.tokenizer.decode(tenants.reference(ids, MAX_TOKENS), skip_special_tokens=True)
        for case, (text, _) in zip(CASES, together, strict=True):
            if case[0] == store and case[2] is None:
                assert text == want, case
    accepted = {case: n for case, (_, n) in zip(CASES, together, strict=True)}
    assert all(accepted[(s, "none", seed)] == 0 for s in CORPORA for seed in (None, 7))
    # each store holds its own prompt's greedy answer: every greedy request drafts from the store it named
    assert all(accepted[(s, "crest", None)] > 0 for s in CORPORA), accepted

    for name in CORPORA:  # every learned row went to the store its request named
        learner = tenants.engine.learner(name)
        assert learner is not None and learner.flush(timeout=30)
    rows = learned_prompts(db_dsn)
    for name, prompt in PROMPTS.items():
        ids = tenants.tokenizer.encode(prompt, add_special_tokens=False)
        assert rows.get(name), f"store {name!r} learned nothing"
        assert all(len(kept) > 0 and ids[-len(kept) :] == kept for kept in rows[name]), (name, rows[name])

    assert all(n > 1 for n in grouped.values()), grouped  # one round trip carried several rows of a store
