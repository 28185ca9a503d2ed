"""The vLLM proposer's hot path (crest.integrations.rows, crest.integrations.chain's `ChainStream`): a row follows
its last deep chain without a lookup, a deep recent-tier match drafts without the database, the rest look up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crest_client.draft import Draft, path_probabilities

from crest.config import IngestOptions
from crest.decoding.policy import DraftPolicy
from crest.drafters.recent import RecentOptions
from crest.drafting.hub import DraftHub, LearnOptions
from crest.ingest.pipeline import ingest
from crest.integrations.chain import ChainStream
from crest.integrations.rows import DEEP_MATCH, ProposerRow, draft_chains

pytest_plugins = ["tests.fix_corpus"]


def _chain(tokens: list[int], weights: list[int]) -> Draft:
    k = len(tokens)
    return Draft(np.array(tokens, np.int64), np.arange(-1, k - 1, dtype=np.int32), np.array(weights, np.int64), 3, 10)


def test_a_stream_goes_on_only_while_the_target_follows_it() -> None:
    stream = ChainStream()
    stream.start(_chain([5, 6, 7, 8, 9, 10], [8, 8, 6, 6, 3, 3]), {"recent": 6, "prompt": 2}, at=100)
    assert stream.take(2, at=100) is not None and stream.take(7, at=100) is None  # it holds 6 tokens
    stream.advance(100, [5, 6])  # one chain token accepted, then the bonus token: the stream's next two
    nxt = stream.take(3, at=102)
    assert nxt is not None and nxt.tokens.tolist() == [7, 8, 9]
    # the path probabilities are conditioned on the consumed prefix (6 of the 8 that went through token 6)
    assert path_probabilities(nxt).tolist() == pytest.approx([6 / 8, 6 / 8, 3 / 8])
    assert stream.parts == {"recent": 4}  # the prompt's tree held only the consumed tokens
    assert stream.take(3, at=103) is None  # another context than the one it follows
    stream.advance(102, [7, 99])  # the target left the path
    assert stream.take(1, at=104) is None and stream.parts == {}


@pytest.fixture
def hub(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> Iterator[DraftHub]:
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": "the cat sat on the mat " * 40}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=IngestOptions(top_t=50))
    learning = LearnOptions(record=False, refresh_interval=0.0, recent=RecentOptions(capacity=4096), feed_interval=0)
    found = DraftHub(dsn=db_dsn, read_dsn=db_dsn, learning=learning)
    yield found
    found.close()


def test_rows_on_a_text_served_before_draft_it_from_memory_without_the_database(hub: DraftHub) -> None:
    rng = np.random.default_rng(7)
    served = [int(t) for t in rng.integers(2, 10, size=400)]  # a text the store never saw, served once before
    store = hub.store("words")
    index = hub.recent("words")
    assert index is not None
    index.add(np.array(served))
    calls = {"n": 0}
    lookup = index.draft

    def counted(*args: Any, **kwargs: Any) -> Draft | None:
        calls["n"] += 1
        return lookup(*args, **kwargs)

    index.draft = counted  # type: ignore[method-assign]
    policy = DraftPolicy(budget=32, adaptive=False)
    rows = []
    for start in (0, 150):
        parts = hub.row_parts("crest+prompt", "words")
        rows.append(ProposerRow(parts.drafter, parts.leases, 0, served[start : start + DEEP_MATCH]))
    k, steps, before = 8, 0, store.stats["lookups"]
    while all(len(r.tokens) < DEEP_MATCH + 200 for r in rows):
        chains = draft_chains(policy, [(r, k) for r in rows])
        for row, chain, start in zip(rows, chains, (0, 150), strict=True):
            at = len(row.tokens)
            truth = served[start + at : start + at + k + 1]
            assert chain.tokens.tolist() == truth[:k]  # the served text's continuation, whole, every step
            row.chain = chain
            row.verified(truth)
            row.stream.advance(at, truth)
            row.tokens.extend(truth)
        steps += 1
    assert store.stats["lookups"] == before  # no row ever needed the database
    assert calls["n"] <= len(rows) * steps / 2  # the stream drafted most steps: no lookup at all
    assert all(r.parts == {"recent": r.accepted} and r.accepted == k * steps for r in rows)


def test_a_row_off_every_stream_looks_up_its_store_once_per_step(hub: DraftHub) -> None:
    text = [int(t) for t in np.random.default_rng(3).integers(2, 10, size=64)]  # nothing served: no recent match
    parts = hub.row_parts("crest+prompt", "words")
    row = ProposerRow(parts.drafter, parts.leases, 0, text[:20])
    store = hub.store("words")
    policy = DraftPolicy(budget=32, adaptive=False)
    for step in range(5):
        before = store.stats["lookups"]
        (chain,) = draft_chains(policy, [(row, 4)])
        assert store.stats["lookups"] == before + 1, step
        at = len(row.tokens)
        first = chain.tokens.tolist()[:1]
        nxt = [next(t for t in (text[at], 2, 3) if [t] != first)]  # the target takes none of the chain
        row.chain = chain
        row.verified(nxt)
        row.stream.advance(at, nxt)
        row.tokens.extend(nxt)
