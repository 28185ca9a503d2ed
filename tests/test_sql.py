"""Every inspection query in sql/ runs on a real store and returns the figures it documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.test_store import ROWS, publish

SQL = Path(__file__).resolve().parent.parent / "sql"


def _run(dsn: str, name: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute((SQL / name).read_text())
        return list(cur.fetchall())


def test_every_sql_file_is_tested() -> None:
    assert sorted(p.name for p in SQL.glob("*.sql")) == sorted(FILES)


# roles.sql: test_roles.py; learned.sql: test_learning.py
FILES = ["coverage.sql", "tree_sizes.sql", "top_ngrams.sql", "disk_use.sql", "roles.sql", "learned.sql"]


@pytest.fixture()
def demo(db_dsn: str) -> str:
    publish(db_dsn, "demo", ROWS)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE crest_stores SET figures = %s WHERE name = 'demo'",
            ('{"counted": {"1": 10, "2": 20, "3": 30}, "positions": {"1": 100, "2": 99, "3": 98}}',),
        )
    return db_dsn


def test_coverage(demo: str) -> None:
    rows = {r["n"]: r for r in _run(demo, "coverage.sql")}
    assert rows[2]["kept"] == 2 and rows[2]["counted"] == 20
    assert rows[2]["covered_positions"] == 14  # two 2-grams of count 7
    assert float(rows[1]["covered_pct"]) == pytest.approx(7.0)


def test_tree_sizes(demo: str) -> None:
    rows = {r["n"]: r for r in _run(demo, "tree_sizes.sql")}
    assert rows[3]["avg_nodes"] == 8 and rows[2]["min_nodes"] == 2 and rows[2]["max_nodes"] == 6
    assert rows[1]["nodes_1_4"] == 1


def test_top_ngrams_render_text(demo: str) -> None:
    rows = _run(demo, "top_ngrams.sql")
    texts = {tuple(r["token_ids"]): r["text"] for r in rows}
    assert texts[(3, 4, 5)] == "<3><4><5>"
    assert texts[(9, 9)] == "<9><9>"
    assert len(rows) == len(ROWS)


def test_disk_use(demo: str) -> None:
    (row,) = _run(demo, "disk_use.sql")
    assert row["store"] == "demo" and row["state"] == "published"
    assert row["table_bytes"] > 0 and row["index_bytes"] > 0 and row["vocab_bytes"] > 0
    assert row["client_data_bytes"] > 0  # the demo store has a token table and key filter
    total = row["table_bytes"] + row["index_bytes"] + row["client_data_bytes"]
    assert float(row["bytes_per_ngram"]) == pytest.approx(total / len(ROWS), abs=0.1)
