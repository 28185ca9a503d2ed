"""`crest bench ingest`: a full ingest reported as throughput per stage, peak memory and size against targets."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from crest.cli.app import app
from tests.fix_corpus import WORDS, word_tokenizer_dir  # noqa: F401  (fixture)


def test_bench_ingest_prints_figures_and_drops_its_store(db_dsn: str, tmp_path: Path, word_tokenizer_dir: Path) -> None:  # noqa: F811
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)))
    args = ["bench", "ingest", str(corpus), "--tokenizer", str(word_tokenizer_dir), "--store", "b", "--top-t", "20"]
    done = CliRunner().invoke(app, [*args, "--json", "--dsn", db_dsn])
    assert done.exit_code == 0, done.output
    results = json.loads(done.output)
    assert results["benchmark"] == "ingest" and results["command"].startswith("crest ")
    (figures,) = results["rows"]
    assert figures["documents"] == 6 and figures["tokens"] == 240 and figures["ngrams_stored"] > 0
    assert figures["count_tokens_per_second"] > 0 and figures["peak_rss_bytes"] > 0
    assert figures["bytes_per_ngram"] == pytest.approx(figures["bytes_on_disk"] / figures["ngrams_stored"])
    assert figures["meets_seconds_target"] is True and figures["meets_peak_rss_bytes_target"] is True
    with psycopg.connect(db_dsn) as conn:  # --drop is the default: the benchmark leaves nothing behind
        assert conn.execute("SELECT count(*) FROM crest_stores WHERE state = 'published'").fetchone() == (0,)
