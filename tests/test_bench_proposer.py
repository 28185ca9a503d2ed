"""`crest bench proposer` (crest.bench.proposer): the proposer alone on two passes, recent tier off and on, then in a
new process warmed from the learned log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crest.bench.proposer import PassFigures, StandInClock, run_passes, run_suffix
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
    want = {(p, r) for p in ("first sight", "again") for r in (False, True)} | {("another replica", True)}
    assert set(figures) == want
    again, without, replica = figures["again", True], figures["again", False], figures["another replica", True]
    assert again.tokens == without.tokens == replica.tokens == sum(len(out) for _, out in requests)
    assert again.row()["M"] > 3.0 > without.row()["M"], (again.row(), without.row())  # K + 1 = 5 at most
    # a new process knows what the last one served: its recent tier is warmed from the learned log
    assert replica.row()["M"] > 3.0, replica.row()
    assert all(f.step_ms and min(f.step_ms) > 0 for f in figures.values())


def test_vllm_suffix_drafts_a_request_it_served_whole_through_the_same_runner() -> None:
    pytest.importorskip("arctic_inference.suffix_decoding")
    requests = [([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]), ([9, 9, 9], [12, 13, 14, 15, 16, 17, 18, 19])]
    first, again, replica = run_suffix(requests, concurrency=2)
    assert (first.label, again.label, again.method) == ("first sight", "again", "vllm suffix")
    assert first.tokens == again.tokens == 16 and again.accepted > first.accepted
    assert replica.label == "another replica" and replica.accepted < again.accepted  # its cache died with it
    assert again.row()["recent tier"] == "-"


def test_the_stand_in_forward_grows_with_the_draft_tokens_it_verifies() -> None:
    """`--token-ms`: a CPU's forward costs more with each draft token it verifies, and tokens/s counts it."""
    clock = StandInClock(0.02, token=0.004)
    before = clock()
    clock.tick(0)
    clock.tick(5)
    assert clock.forwards == 2 and clock.seconds == pytest.approx(0.06)
    assert clock() - before >= 0.06
    flat = PassFigures("x", False, 1, tokens=30, accepted=20, step_ms=[1.0, 1.0], cpu_ms=[], forward=0.02)
    assert flat.tokens_per_second() == pytest.approx(30 / 0.042)  # two flat forwards and the proposer's time
    shaped = PassFigures("x", False, 1, tokens=30, accepted=20, step_ms=[1.0, 1.0], cpu_ms=[], forward=0.02,
                         engine=clock.seconds)  # fmt: skip
    assert shaped.tokens_per_second() == pytest.approx(30 / 0.062)


@pytest.mark.parametrize("value", ["-1", "nan"], ids=["negative", "nan"])
def test_a_bad_token_cost_is_a_usage_error(db_dsn: str, value: str) -> None:
    from tests.fix_cli import run_cli

    done = run_cli("bench", "proposer", "-s", "nope", "--token-ms", value, dsn=db_dsn)
    assert done.returncode == 2 and "--token-ms" in done.stderr and "Traceback" not in done.stderr, done.stderr
