"""The dense lookup benchmark on real PostgreSQL with pgvector: candidate indexes side by side on a copy of a dense
part (tests/fix_dense.py's), their recall against exact search and CPU time, and the variant grammar; `crest ingest
--dense-index` refuses an unknown kind with a clear message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from crest.bench.dense_lookup import compare_indexes, noisy_queries, parse_variant, stored_vectors
from crest.db.dense import AnnIndex
from crest.errors import ConfigError

pytest_plugins = ["tests.fix_dense"]


def test_candidates_are_measured_side_by_side_on_scratch_copies(db_dsn: str, dense_store: Any) -> None:
    with psycopg.connect(db_dsn) as conn:
        vectors = stored_vectors(conn, dense_store.store_id)
    assert vectors.shape == (dense_store.tokens - 2 * dense_store.documents, 16)
    queries = noisy_queries(vectors, count=40, noise=0.05)
    labels = ["ivfflat", "hnsw:ef_search=40", "ivfflat+halfvec", "ivfflat:lists=8:probes=1"]
    candidates = [parse_variant(v, rows=vectors.shape[0]) for v in labels]
    figures = compare_indexes(db_dsn, dense_store.store_id, candidates, queries, vectors, batch=4, k=4, rounds=5)
    assert figures["rows"] == vectors.shape[0] and figures["batch"] == 4 and len(figures["load_average"]) == 6
    found = figures["variants"]
    assert list(found) == labels
    small = found["ivfflat"]["index"]  # a small part: every list probed
    assert small["kind"] == "ivfflat" and small["vector"] == "vector" and small["probes"] == small["lists"]
    assert found["ivfflat"]["recall"] == 1.0  # every list probed: exact
    assert found["hnsw:ef_search=40"]["recall"] >= 0.9 and found["ivfflat+halfvec"]["recall"] >= 0.9
    assert found["ivfflat:lists=8:probes=1"]["recall"] < 1.0  # one list of eight misses neighbours: recall is real
    for row in found.values():
        assert 0 < row["p50_ms"] <= row["p95_ms"] and row["index_bytes"] > 0 and row["table_bytes"] > 0
        assert row["cpu_ms"] is not None and row["cpu_ms"] > 0  # the embedded server runs on this machine
    with psycopg.connect(db_dsn) as conn:  # the scratch copies are gone
        left = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'crest_dense_bench_%'").fetchone()
    assert left == (0,)


def test_variants_parse_kind_vector_and_settings() -> None:
    assert parse_variant("ivfflat:lists=10:probes=3", rows=100_000).index == AnnIndex(
        kind="ivfflat", lists=10, probes=3
    )
    assert parse_variant("ivfflat", rows=100_000).index.record() == {
        "kind": "ivfflat",
        "vector": "vector",
        "lists": 2000,  # about 50 rows a list, 1% probed (1,000 rows a query)
        "probes": 20,
    }
    assert parse_variant("hnsw+halfvec:ef_search=24", rows=10).index == AnnIndex(vector="halfvec", ef_search=24)
    for bad in ("ivf", "ivfflat+float8", "hnsw:ef=40", "hnsw:ef_search=many"):
        with pytest.raises(ConfigError, match="bad dense index variant"):
            parse_variant(bad, rows=1000)


def test_ingest_refuses_an_unknown_dense_index(
    corpus: Path, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from crest.cli.app import main

    monkeypatch.setenv("CREST_HOME", str(tmp_path))
    args = ["ingest", str(corpus), "--store", "w", "--tokenizer", str(tiny_dir), "--dense-model", str(tiny_dir)]
    with pytest.raises(SystemExit) as done:
        main([*args, "--dense-index", "annoy"])
    assert done.value.code == 2  # ConfigError, before anything is read or built
    assert "--dense-index must be one of ivfflat, hnsw, not 'annoy'" in capsys.readouterr().err
