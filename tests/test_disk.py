"""A store's bytes on disk (`crest.ingest.disk`): the hash index model against PostgreSQL's, and budgets kept.

The hash index's size swings with the row count (bucket counts are powers of two, split points allocate ahead,
overflow pages stay); the model must never be under what PostgreSQL builds, at row counts on both sides of its
steps. A `--budget` build must report (as `crest stores` does) no more bytes than its budget, and fill most of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psycopg
import pytest

from crest.config import IngestOptions
from crest.ingest.disk import PAGE, fit_count, hash_buckets, hash_index_bytes
from crest.ingest.pipeline import ingest
from tests.fix_corpus import copy_stdlib_sample

# rows on both sides of the steps: 4 buckets split (1,636), 8 (3,272), 128 buckets (52,352), 256 (104,704)
ROWS = [500, 1_600, 1_788, 3_311, 15_000, 43_728, 52_000, 53_000, 100_000, 104_000, 106_000, 202_162]


@pytest.mark.parametrize("rows", ROWS, ids=[f"{r}-rows" for r in ROWS])
def test_the_hash_index_model_is_never_under_postgresql(db_dsn: str, rows: int) -> None:
    table = f"crest_disk_{rows}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} (key bytea) WITH (fillfactor = 100)")
        keys = "SELECT int4send(i) || int4send(i * 7) FROM generate_series(1, %s) i"
        conn.execute(f"INSERT INTO {table} {keys}", (rows,))
        conn.execute(f"VACUUM (ANALYZE) {table}")  # as crest.db.build.Build.finish_tables
        conn.execute(f"CREATE INDEX ON {table} USING hash (key) WITH (fillfactor = 100)")
        row = conn.execute(f"SELECT pg_indexes_size('{table}')").fetchone()
        conn.execute(f"DROP TABLE {table}")
    assert row is not None
    built, model = int(row[0]), int(hash_index_bytes(rows))
    assert built <= model <= 1.5 * built + 3 * PAGE, (built, model)


def test_buckets_are_rows_over_409_truncated_then_rounded_up_to_a_power_of_two() -> None:
    got = hash_buckets(np.array([10, 818, 819, 1227, 1636, 1637, 2045, 52_351, 52_352, 400_000]))
    assert got.tolist() == [2, 2, 2, 4, 4, 4, 8, 128, 128, 1024]


def test_fit_count_ends_at_the_first_step_over() -> None:
    rows = np.array([1, 2, 3, 4, 5])
    cum = np.array([10, 30, 25, 40, 35])  # pruning can lower the bytes as steps join
    fixed = 1000
    base = int(hash_index_bytes(5)) + fixed  # the index of 1..5 rows: the same pages
    assert [fit_count(cum, rows, budget=base + b, fixed=fixed) for b in (5, 11, 29, 31, 39, 41)] == [0, 1, 1, 3, 3, 5]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """About 100 KB of Python's standard library."""
    return copy_stdlib_sample(tmp_path_factory.mktemp("stdlib"))


@pytest.mark.parametrize(
    ("rule", "budget"),
    [("lookup", 250_000), ("lookup", 800_000), ("prune", 250_000), ("prune", 600_000)],
    ids=["lookup-250k", "lookup-800k", "prune-250k", "prune-600k"],
)
def test_a_budget_build_reports_no_more_bytes_than_its_budget(
    db_dsn: str, corpus: str, smollm2_gguf: Path, rule: str, budget: int
) -> None:
    opts = IngestOptions(max_matches=30, tree_size=16, budget=budget, suffix_rule=rule)
    got = ingest([corpus], store=f"disk_{rule}", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=opts)
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT figures FROM crest_stores WHERE id = %s", (got.store_id,)).fetchone()
    assert row is not None
    reported = int(row[0]["table_bytes"]) + int(row[0]["index_bytes"])  # what `crest stores` shows
    assert reported == got.table_bytes + got.index_bytes
    assert 0.8 * budget < reported <= budget, reported
