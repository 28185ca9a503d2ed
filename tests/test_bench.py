"""`crest bench ingest`: a full ingest reported as throughput per stage, peak memory and size."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from crest.cli.app import app
from tests.fix_corpus import WORDS, word_tokenizer_dir  # noqa: F401  (fixture)


def test_bench_ingest_prints_figures_and_drops_its_store(
    db_dsn: str,
    tmp_path: Path,
    word_tokenizer_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)))
    args = ["bench", "ingest", str(corpus), "--tokenizer", str(word_tokenizer_dir), "--store", "b", "--top-t", "20"]
    monkeypatch.setattr("sys.argv", ["crest", *args])  # what a shell hands `crest`; CliRunner leaves pytest's
    done = CliRunner().invoke(app, [*args, "--json", "--dsn", db_dsn])
    assert done.exit_code == 0, done.output
    results = json.loads(done.output)
    assert results["benchmark"] == "ingest" and results["command"] == shlex.join(["crest", *args])
    (figures,) = results["rows"]
    assert figures["documents"] == 6 and figures["tokens"] == 240 and figures["ngrams_stored"] > 0
    assert figures["count_tokens_per_second"] > 0 and figures["peak_rss_bytes"] > 0
    assert figures["bytes_per_ngram"] == pytest.approx(figures["bytes_on_disk"] / figures["ngrams_stored"])
    assert figures["seconds"] > 0
    assert not any(key.startswith("meets_") for key in figures)  # figures only: docs/benchmarks.md compares them
    with psycopg.connect(db_dsn) as conn:  # --drop is the default: the benchmark leaves nothing behind
        assert conn.execute("SELECT count(*) FROM crest_stores WHERE state = 'published'").fetchone() == (0,)


def test_bench_lookup_batch_times_draft_many(db_dsn: str) -> None:
    from tests.fix_store import ROWS, publish

    publish(db_dsn, "demo", ROWS)
    args = ["bench", "lookup", "--store", "demo", "--batch", "8", "--samples", "20", "--json", "--dsn", db_dsn]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    results = json.loads(done.output)
    assert results["benchmark"] == "lookup-batch" and results["store"] == "demo"
    (figures,) = results["rows"]
    assert figures["batch"] == 8 and figures["batches"] >= 100
    assert figures["drafts_per_batch"] == 8  # every sampled context ends in a stored n-gram
    assert 0 < figures["batch_median_ms"] <= figures["batch_p99_ms"]
    assert figures["context_median_us"] == pytest.approx(figures["batch_median_ms"] * 1000 / 8)
    assert figures["keys_median_ms"] > 0 and figures["decode_median_ms"] > 0
    assert figures["round_trip_median_ms"] <= figures["batch_median_ms"]


def test_bench_lookup_batch_refuses_a_bad_batch(db_dsn: str) -> None:
    from crest.bench.lookup_batch import bench_batch
    from crest.errors import ConfigError

    with pytest.raises(ConfigError, match="must be positive"):
        bench_batch(db_dsn, "demo", batch=0)
