"""The dense drafters in `crest serve`: each row's hidden state reaches its drafter, a step's dense lookups are one
ANN statement for the whole batch, greedy output over the server equals plain greedy decoding, and a database
that is down costs drafts only.

Real PostgreSQL with pgvector, a tiny random llama over a word tokenizer (tests/fix_dense.py), in float64 so
that batched rows equal rows alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from crest.decoding.generator import SpeculativeGenerator
from crest.drafters.dense_index import DenseIndex, open_dense
from crest.drafters.dense_lease import DenseLease, prefetch_dense
from crest.errors import ModelError
from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Outcome
from tests.fix_dense import DENSE_DRAFTERS, PROMPTS, dense_engine, save_tiny
from tests.fix_proxy import Proxy
from tests.fix_serving import Running, flat_cost

pytest_plugins = ["tests.fix_corpus", "tests.fix_dense"]
pytestmark = pytest.mark.usefixtures("torch_threads")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tiny_dir: Any) -> Any:
    """The tiny model in float64 (the dense part was built in float32: the fingerprint is the same)."""
    from crest.decoding.models import load_model

    return load_model(str(tiny_dir), dtype=torch.float64)


@pytest.fixture(scope="module")
def plain(served: Any) -> dict[str, tuple[list[int], str]]:
    """Each prompt's plain greedy output (ids and text), one request alone."""
    gen = SpeculativeGenerator(served.model, served.tokenizer, adaptive=False)
    found = {}
    for prompt in PROMPTS:
        result = gen.generate(_ids(served.tokenizer, prompt), max_new_tokens=MAX_TOKENS)
        found[prompt] = (result.output_token_ids, result.text)
    return found


def _ids(tokenizer: Any, prompt: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]  # as the server encodes it


def _engine(loaded: Any, dsn: str, *, drafter: str = "dense", retry_interval: float = 5.0) -> Engine:
    return dense_engine(loaded, dsn, drafter=drafter, retry_interval=retry_interval)


@pytest.fixture
def engine(db_dsn: str, dense_store: Any, served: Any) -> Iterator[Engine]:
    """An engine (no thread, no HTTP: tests step its scheduler) drafting from store `words` and its dense part."""
    found = _engine(served, db_dsn)
    yield found
    found.stop()


def _run(engine: Engine, jobs: list[tuple[str, str, str | None]]) -> tuple[list[Outcome], list[int]]:
    """Submit (prompt, drafter, prediction) requests at once, step until done; return outcomes and lookups per step."""
    index = engine.dense_index("words")
    futures = [
        engine.submit(
            engine.request(_ids(engine.tokenizer, p), drafter=d, store=None, prediction=pred,
                           max_tokens=MAX_TOKENS, temperature=0.0),
        )
        for p, d, pred in jobs
    ]  # fmt: skip
    lookups: list[int] = []
    for _ in range(500):
        before = index.lookups
        if not engine.scheduler.step():
            break
        lookups.append(index.lookups - before)
    assert all(f.done() for f in futures)
    return [f.result() for f in futures], lookups


def test_a_batch_step_makes_one_dense_query_for_all_rows(
    engine: Engine, plain: dict[str, tuple[list[int], str]]
) -> None:
    drafters = itertools.cycle(DENSE_DRAFTERS)
    jobs: list[tuple[str, str, str | None]] = [(p, next(drafters), None) for p in PROMPTS]
    jobs.append((PROMPTS[0], "dense", "w9 w9 w9"))  # a prediction merged in: the hidden state still reaches dense
    outcomes, lookups = _run(engine, jobs)
    assert lookups[0] == 1  # the first step: every row's prefill state, in one statement
    assert max(lookups) == 1  # never a second statement within a step
    for (prompt, name, _), outcome in zip(jobs, outcomes, strict=True):
        assert outcome.result.output_token_ids == plain[prompt][0], (prompt, name)
    assert sum(o.accepted_draft_tokens for o in outcomes) > 2 * len(jobs)  # the neighbours' drafts pay
    assert sum(o.accepted_parts.get("dense", 0) for o in outcomes) > 0


def test_prefetch_dense_is_one_search_per_index_and_a_lease_answers_from_it(db_dsn: str, dense_store: Any) -> None:
    index = open_dense("words", dsn=db_dsn)
    try:
        assert index.meta is not None
        rng = np.random.default_rng(0)
        states = rng.normal(size=(5, index.meta.hidden_size)).astype(np.float32)
        leases = [DenseLease(index) for _ in states]
        prefetch_dense(leases, list(states), k=4)
        assert index.lookups == 1
        alone = index.search(states[2:3], k=4)[0]  # the same query alone
        batched = leases[2].search(states[2:3], k=4)[0]
        assert index.lookups == 2  # answered from the batch
        assert [c for c, _ in batched] == [c for c, _ in alone]
        assert np.allclose([s for _, s in batched], [s for _, s in alone], atol=1e-5)  # float32 sums, any order
        assert len(leases[3].search(states[0:1], k=4)[0]) == 4 and index.lookups == 3  # another state: searched
        leases[2].search(states[2:3], k=4)
        assert index.lookups == 4  # an answer is taken once
    finally:
        index.close()


def test_served_greedy_equals_plain_greedy_with_every_dense_drafter(
    db_dsn: str, dense_store: Any, served: Any, plain: dict[str, tuple[list[int], str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(served, db_dsn, drafter="crest+dense+prompt")
    running = Running(create_app(engine), engine, served.model, served.tokenizer)
    try:
        sched = engine.scheduler
        step = sched.step
        index = engine.dense_index("words")
        statements: list[int] = []  # dense statements per step

        def counted() -> bool:
            before = index.lookups
            worked = step()
            statements.append(index.lookups - before)
            return worked

        gate = threading.Event()
        monkeypatch.setattr(sched, "step", lambda: gate.wait() and counted())  # held until every request is queued
        cases = [(prompt, name) for name in DENSE_DRAFTERS for prompt in PROMPTS]

        def ask(case: tuple[str, str]) -> tuple[str, int]:
            reply = running.client().completions.create(
                model="tiny", prompt=case[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"drafter": case[1]}
            )
            own = (reply.usage.model_extra or {}).get("crest", {}) if reply.usage else {}
            return reply.choices[0].text, int(own.get("accepted_draft_tokens", 0))

        with ThreadPoolExecutor(len(cases)) as pool:
            replies = pool.map(ask, cases)
            try:
                deadline = time.monotonic() + 60
                while sched.queued < len(cases):
                    assert time.monotonic() < deadline, f"{sched.queued} of {len(cases)} requests queued"
                    time.sleep(0.01)
            finally:
                gate.set()  # never leave the requests waiting on a failed test
            answers = list(replies)
    finally:
        running.stop()
    accepted: dict[str, int] = dict.fromkeys(DENSE_DRAFTERS, 0)
    for (prompt, name), (text, kept) in zip(cases, answers, strict=True):
        assert text == plain[prompt][1], (prompt, name)
        accepted[name] += kept
    assert all(kept > len(PROMPTS) for kept in accepted.values()), accepted  # every dense drafter drafts over HTTP
    assert statements[0] == 1 and max(statements) == 1  # a full batch of 8 rows first: one statement a step


def test_a_dense_part_of_another_model_is_refused_at_start_and_per_request(
    db_dsn: str, dense_store: Any, tmp_path: Any
) -> None:
    from crest.decoding.models import load_model

    other = load_model(str(save_tiny(tmp_path / "other", seed=4)))
    engine = _engine(other, db_dsn)
    try:
        with pytest.raises(ModelError, match="dense part was built with model"):
            engine.dense_index("words")
        with pytest.raises(ModelError, match="dense part was built with model"):
            engine.request([2, 3], drafter="crest+dense", store=None, prediction=None, max_tokens=4)
    finally:
        engine.stop()


def test_with_the_database_down_the_server_keeps_serving_without_drafts(
    db_dsn: str, dense_store: Any, served: Any, plain: dict[str, tuple[list[int], str]]
) -> None:
    proxy, via = Proxy.fronting(db_dsn)  # down from the start: the dense part opens without an error
    engine = _engine(served, via, retry_interval=0.0)
    try:
        jobs: list[tuple[str, str, str | None]] = [(p, "dense", None) for p in PROMPTS[:4]]
        down, _ = _run(engine, jobs)
        assert [o.result.output_token_ids for o in down] == [plain[p][0] for p, _, _ in jobs]
        assert sum(o.result.draft_tokens for o in down) == 0
        proxy.up()
        up, lookups = _run(engine, jobs)
        assert [o.result.output_token_ids for o in up] == [plain[p][0] for p, _, _ in jobs]
        assert sum(o.result.draft_tokens for o in up) > 0 and max(lookups) == 1  # answers again: drafts
        index: DenseIndex = engine.dense_index("words")
        index.retry_interval = 3600.0  # no reconnecting within this test (a closed listener may still accept)
        proxy.down()  # goes down mid-use: the open connection breaks
        again, _ = _run(engine, jobs)
        assert [o.result.output_token_ids for o in again] == [plain[p][0] for p, _, _ in jobs]
        assert sum(o.result.draft_tokens for o in again) == 0
    finally:
        proxy.down()
        engine.stop()


def test_the_dense_drafters_run_in_generate_serve_and_vllm() -> None:
    from crest.drafters.registry import names

    assert set(DENSE_DRAFTERS) <= set(names("serve")) & set(names("generate")) & set(names("vllm"))


def test_batched_sampled_rows_with_dense_drafts_draw_what_they_draw_alone(
    db_dsn: str, dense_store: Any, served: Any, plain: dict[str, tuple[list[int], str]]
) -> None:
    """Seeded sampled rows drafting from the dense part (alone and in both hybrids), batched with greedy rows through
    the scheduler, emit exactly what the single-sequence generator emits for the same seed and drafter (the same
    trees, the same draws), and they accept dense drafts. The generator's sampled rule is lossless by
    tests/test_sampling.py's chi-square tests; this holds the batched path with dense drafts to it."""
    from crest.drafters.registry import close_drafter, open_drafter

    engine = _engine(served, db_dsn)
    rows: list[tuple[str, str, dict[str, Any]]] = [
        (p, DENSE_DRAFTERS[i % 3], {"temperature": 0.7, "top_k": 5, "seed": 40 + i} if i // 3 % 2 == 0 else {})
        for i, p in enumerate(PROMPTS * 2)
    ]  # 12 rows in a batch of 8, later ones joining as others finish: 6 sampled (each dense drafter twice), 6 greedy
    try:
        futures = [
            engine.submit(engine.request(_ids(engine.tokenizer, p), drafter=d, store=None, prediction=None,
                                         max_tokens=MAX_TOKENS, **o))
            for p, d, o in rows
        ]  # fmt: skip
        for _ in range(500):
            if not engine.scheduler.step():
                break
        outcomes = [f.result(timeout=0) for f in futures]
    finally:
        engine.stop()
    alone = SpeculativeGenerator(served.model, served.tokenizer, cost=flat_cost())  # the scheduler's settings
    for (prompt, name, options), outcome in zip(rows, outcomes, strict=True):
        drafter = open_drafter(name, store="words", dsn=db_dsn)
        try:
            want = alone.generate(_ids(served.tokenizer, prompt), drafter=drafter, max_new_tokens=MAX_TOKENS, **options)
        finally:
            close_drafter(drafter)
        assert outcome.result.output_token_ids == want.output_token_ids, (prompt, name, options)
        if not options:
            assert want.output_token_ids == plain[prompt][0]  # the greedy rows are plain greedy decoding
    sampled = [o for (_, _, options), o in zip(rows, outcomes, strict=True) if options]
    assert sum(o.accepted_parts.get("dense", 0) for o in sampled) >= len(sampled), (
        "sampled rows hardly took dense drafts"
    )
    greedy_texts = {
        plain[p][0] == o.result.output_token_ids for (p, _, opts), o in zip(rows, outcomes, strict=True) if opts
    }
    assert False in greedy_texts  # the sampled rows sample: some leave the greedy path
