"""The live tier's dense part: what `crest serve` served becomes dense entries after a refresh, drafts the same
prompt served again from them, never changes the output, survives a database that is down, and is published with
its live version or not at all.

Real PostgreSQL with pgvector, a tiny random llama over a word tokenizer and the store `words` with a static dense
part built from the model's own continuations of other prompts (tests/fix_dense.py), in float64.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
import torch

from crest.db import dense as dense_db
from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.hidden import final_hidden
from crest.drafting.hub import LearnOptions
from crest.learning import refresh_live
from crest.serving.engine import Engine
from crest.serving.scheduler import Outcome
from tests.fix_dense import column_type, dense_engine, ingest_dense
from tests.fix_learning import published, start_paused_refresh, wait_until_unlocked
from tests.fix_proxy import Proxy

pytest_plugins = ["tests.fix_corpus", "tests.fix_dense"]
pytestmark = pytest.mark.usefixtures("torch_threads")

# prompts the static dense part never saw (its corpus continues tests/fix_dense.PROMPTS); the last ends in eos
LIVE_PROMPTS = ["w20 w21 w22 w23", "w24 w25 w26", "w19 w2 w25"]
MAX_TOKENS = 28
QUIET = LearnOptions(refresh_interval=0, refresh_min_tokens=0, flush_interval=0.05)  # refreshes when told


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Any:
    """The tiny model in float64 (the dense part was built in float32: the fingerprint is the same)."""
    from crest.decoding.models import load_model

    return load_model(str(tiny_dir), dtype=torch.float64)


@pytest.fixture(scope="module")
def plain(served: Any) -> dict[str, list[int]]:
    """Each prompt's plain greedy output, one request alone."""
    gen = SpeculativeGenerator(served.model, served.tokenizer, adaptive=False)
    ids = {p: _ids(served.tokenizer, p) for p in LIVE_PROMPTS}
    return {p: gen.generate(ids[p], max_new_tokens=MAX_TOKENS).output_token_ids for p in LIVE_PROMPTS}


def _ids(tokenizer: Any, prompt: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]  # as the server encodes it


def _engine(loaded: Any, dsn: str, *, learning: LearnOptions = QUIET, retry_interval: float = 5.0) -> Engine:
    return dense_engine(loaded, dsn, learning=learning, retry_interval=retry_interval)


@pytest.fixture
def engine(db_dsn: str, dense_store: Any, served: Any) -> Iterator[Engine]:
    """An engine that learns (no thread, no HTTP: tests step its scheduler) on store `words` and its dense part."""
    found = _engine(served, db_dsn)
    yield found
    found.stop()


def _serve(
    engine: Engine,
    prompts: list[str],
    *,
    drafter: str = "dense",
    statements: list[int] | None = None,
    written: bool = True,
) -> list[Outcome]:
    """Submit the prompts at once, step until done, write what they taught (unless not `written`); return outcomes.

    `statements` gets the dense index's ANN statements of each step.
    """
    futures = [
        engine.submit(engine.request(_ids(engine.tokenizer, p), drafter=drafter, store=None, prediction=None,
                                     max_tokens=MAX_TOKENS, temperature=0.0))
        for p in prompts
    ]  # fmt: skip
    index = engine.dense_index("words") if drafter.startswith("dense") or "+dense" in drafter else None
    for _ in range(1000):
        before = index.lookups if index is not None else 0
        if not engine.scheduler.step():
            break
        if statements is not None and index is not None:
            statements.append(index.lookups - before)
    learner = engine.learner("words")
    assert learner is not None and (not written or learner.flush(timeout=30))
    return [f.result() for f in futures]


def _learned(dsn: str) -> list[tuple[list[int], int, int | None, int | None, bytes | None]]:
    """Return the learned rows of `words`: (tokens, prompt tokens, dense version, dense first, dense bytes)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tokens, prompt_tokens, dense_version, dense_first, dense FROM crest_learned"
            " WHERE store = 'words' ORDER BY id"
        ).fetchall()
    return [(np.frombuffer(t, "<u4").tolist(), int(p), v, f, None if d is None else bytes(d)) for t, p, v, f, d in rows]


def _live_entries(dsn: str, live_id: int) -> list[list[int]]:
    """Return the continuations of a live version's dense part."""
    with psycopg.connect(dsn) as conn:
        query = psycopg.sql.SQL("SELECT continuation FROM {}").format(dense_db.dense_table(live_id))
        return [list(c) for (c,) in conn.execute(query)]


def test_served_output_becomes_live_dense_entries_after_a_refresh(
    engine: Engine, db_dsn: str, served: Any, plain: dict[str, list[int]]
) -> None:
    outcomes = _serve(engine, LIVE_PROMPTS)
    assert [o.result.output_token_ids for o in outcomes] == [plain[p] for p in LIVE_PROMPTS]
    meta = engine.dense_index("words").meta
    assert meta is not None
    rows = _learned(db_dsn)
    assert len(rows) == len(LIVE_PROMPTS)
    expected: list[list[int]] = []
    for tokens, _, version, first, blob in rows:  # in the order the requests finished
        prompt = next(p for p in LIVE_PROMPTS if tokens[-len(plain[p]) :] == plain[p])
        assert version == meta.store_id and first is not None and blob is not None
        vectors = np.frombuffer(blob, "<f2").reshape(-1, meta.dims).astype(np.float32)  # [n, D]
        assert first + len(vectors) == len(tokens) - 1  # a state per position with a token after it
        # each vector is the state at its row position, as a plain forward over prompt + output computes it
        ids = _ids(served.tokenizer, prompt) + plain[prompt]
        cut = len(ids) - len(tokens)
        states = final_hidden(served.model, torch.tensor([ids]))[0].float().numpy()  # [T, H]
        want = meta.project(states[cut + first : cut + first + len(vectors)])
        assert np.min(np.sum(want * vectors, axis=1)) > 0.99
        expected += [tokens[p + 1 : p + 1 + meta.continuation] for p in range(first, len(tokens) - 2)]

    done = refresh_live(db_dsn, "words")
    assert done is not None and done.dense_rows == len(expected)
    assert sorted(_live_entries(db_dsn, done.store_id)) == sorted(expected)
    index = engine.dense_index("words")
    index._live_next = 0.0  # look for a live part on the next search, not within a second
    index.search(np.zeros((1, meta.hidden_size)), k=1)
    assert index.live == done.store_id


@pytest.mark.parametrize("precision", ["half", "single"])
def test_the_live_part_takes_the_static_parts_precision(
    db_dsn: str, corpus: Path, tiny_dir: Path, served: Any, precision: str
) -> None:
    static = ingest_dense(db_dsn, corpus, tiny_dir, precision=precision)
    engine = _engine(served, db_dsn)
    try:
        _serve(engine, LIVE_PROMPTS[:1])
        done = refresh_live(db_dsn, "words")
        assert done is not None and done.dense_rows > 0
        want = f"{dense_db.PRECISIONS[precision]}(16)"
        assert column_type(db_dsn, static.store_id) == column_type(db_dsn, done.store_id) == want
        with psycopg.connect(db_dsn) as conn:
            live = dense_db.read_meta(conn, done.store_id)
        assert live is not None and live.index.vector == dense_db.PRECISIONS[precision]  # recorded as built
        index = engine.dense_index("words")
        index._live_next = 0.0  # look for the live part on the next search
        assert len(index.search(np.ones((1, live.hidden_size)), k=4)[0]) == 4  # static and live in one statement
        assert index.live == done.store_id
    finally:
        engine.stop()


def test_the_same_prompt_served_again_drafts_from_the_live_entries_and_stays_exact(
    engine: Engine, db_dsn: str, plain: dict[str, list[int]]
) -> None:
    first = _serve(engine, LIVE_PROMPTS)
    done = refresh_live(db_dsn, "words")
    assert done is not None and done.dense_rows > 0
    engine.dense_index("words")._live_next = 0.0  # look for the live part now, not within a second
    statements: list[int] = []
    again = _serve(engine, LIVE_PROMPTS, statements=statements)
    assert engine.dense_index("words").live == done.store_id
    assert statements[0] == 1 and max(statements) == 1  # static and live entries: one statement a step
    for outcomes in (first, again):
        assert [o.result.output_token_ids for o in outcomes] == [plain[p] for p in LIVE_PROMPTS]
    before = sum(o.accepted_parts.get("dense", 0) for o in first)
    after = sum(o.accepted_parts.get("dense", 0) for o in again)
    new = sum(len(o.result.output_token_ids) for o in again)
    steps = sum(o.result.forward_passes for o in again)
    assert after >= 0.75 * new and after > 2 * before, (before, after, new)  # the live entries draft the output
    assert steps <= new / 3


def test_with_the_database_down_nothing_errors_and_the_published_live_part_is_kept(
    db_dsn: str, dense_store: Any, served: Any, plain: dict[str, list[int]]
) -> None:
    proxy, via = Proxy.fronting(db_dsn)
    proxy.up()
    engine = _engine(served, via, retry_interval=0.0)
    try:
        _serve(engine, LIVE_PROMPTS[:1])
        kept = refresh_live(db_dsn, "words")
        assert kept is not None and kept.dense_rows > 0
        entries = _live_entries(db_dsn, kept.store_id)
        learner = engine.learner("words")
        assert learner is not None
        proxy.down()
        down = _serve(engine, LIVE_PROMPTS, written=False)  # drafts, recording and writes all fail: requests do not
        assert [o.result.output_token_ids for o in down] == [plain[p] for p in LIVE_PROMPTS]
        assert not learner.flush(timeout=0.5)  # the learned rows are kept for when the database is back
        stats = learner.stats
        assert (stats["queued"], stats["dropped_rows"]) == (len(LIVE_PROMPTS), 0) and stats["errors"] > 0, stats
        with pytest.raises(Exception):  # noqa: B017 - a refresh through a database that is down fails, said
            refresh_live(via, "words")
        assert published(db_dsn, "words")["live"] == kept.store_id
        assert _live_entries(db_dsn, kept.store_id) == entries  # nothing published was lost
        proxy.up()
        engine.dense_index("words")._live_next = 0.0
        back = _serve(engine, LIVE_PROMPTS[:1])  # drafts from the live part again
        assert back[0].result.output_token_ids == plain[LIVE_PROMPTS[0]]
        assert back[0].accepted_parts.get("dense", 0) >= 0.75 * len(plain[LIVE_PROMPTS[0]])
    finally:
        proxy.down()
        engine.stop()


def test_a_refresh_killed_before_publication_leaves_the_whole_previous_live_version(
    engine: Engine, db_dsn: str, tmp_path: Path
) -> None:
    _serve(engine, LIVE_PROMPTS[:1])
    first = refresh_live(db_dsn, "words")
    assert first is not None and first.dense_rows > 0
    entries = _live_entries(db_dsn, first.store_id)
    _serve(engine, LIVE_PROMPTS[1:])

    proc = start_paused_refresh(db_dsn, tmp_path / "home", "live-dense")  # live entries in, not indexed
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_unlocked(db_dsn)
    assert published(db_dsn, "words")["live"] == first.store_id
    assert _live_entries(db_dsn, first.store_id) == entries  # the published live version whole, dense part too

    again = refresh_live(db_dsn, "words")
    assert again is not None and again.replaced == first.store_id and again.dense_rows > first.dense_rows
    with psycopg.connect(db_dsn) as conn:
        live = conn.execute("SELECT id, state FROM crest_stores WHERE tier = 'live'").fetchall()
        tables = conn.execute("SELECT relname FROM pg_class WHERE relname ~ '^crest_dense_s[0-9]+$'").fetchall()
    assert live == [(again.store_id, "published")]  # the killed build and the replaced version are gone
    assert sorted(t for (t,) in tables) == sorted(f"crest_dense_s{i}" for i in (dense_store_id(db_dsn), again.store_id))
    assert len(_live_entries(db_dsn, again.store_id)) == again.dense_rows


def dense_store_id(dsn: str) -> int:
    """Return the published static version of `words`."""
    return published(dsn, "words")["static"]


def test_a_live_version_of_a_store_without_a_dense_part_has_none(
    db_dsn: str, corpus: Path, tiny_dir: Path, served: Any
) -> None:
    from crest.ingest.pipeline import ingest
    from tests.fix_dense import OPTIONS

    ingest([str(corpus)], store="words", tokenizer=str(tiny_dir), dsn=db_dsn, options=OPTIONS)
    engine = _engine(served, db_dsn)
    try:
        outcomes = _serve(engine, LIVE_PROMPTS[:1], drafter="crest")
        assert outcomes[0].dense is None and engine.learn_dense("words") is None
        assert _learned(db_dsn)[0][2:] == (None, None, None)
        done = refresh_live(db_dsn, "words")
        assert done is not None and done.dense_rows == 0
    finally:
        engine.stop()
