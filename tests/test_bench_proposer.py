"""`crest bench proposer` (crest.bench.proposer): the proposer alone on two passes, recent tier off and on."""

from __future__ import annotations

import json
from pathlib import Path

from crest.bench.proposer import run_passes
from crest.config import IngestOptions
from crest.ingest.pipeline import ingest

pytest_plugins = ["tests.fix_corpus"]


def test_the_second_pass_drafts_whole_answers_from_the_recent_tier_only(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": "the cat sat on the mat " * 40}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=IngestOptions(top_t=50))
    order = [2, 5, 7, 3, 8, 4, 6, 2, 8, 3, 5, 6, 7, 4, 2, 3, 8, 6, 5, 7, 4, 3, 2, 8]  # an order the store never saw
    requests = [(order[i : i + 4], order[i + 4 :] + order[:i]) for i in range(4)]
    figures = {(f.label, f.recent): f for f in run_passes("words", requests, dsn=db_dsn, k=4, concurrency=4, vocab=9)}
    assert set(figures) == {(p, r) for p in ("first sight", "again") for r in (False, True)}
    again, without = figures["again", True], figures["again", False]
    assert again.tokens == without.tokens == sum(len(out) for _, out in requests)
    assert again.row()["M"] > 3.0 > without.row()["M"], (again.row(), without.row())  # K + 1 = 5 at most
    assert all(f.step_ms and min(f.step_ms) > 0 for f in figures.values())
