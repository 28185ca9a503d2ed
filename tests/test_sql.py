"""Every inspection query in sql/ runs on a real store and returns the figures it documents."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from crest.db.queries import read_query, run_query
from crest.learning import append_learned
from tests.fix_store import ROWS, publish

SQL = Path(__file__).resolve().parent.parent / "sql"


def _run(dsn: str, name: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute((SQL / name).read_text())
        return list(cur.fetchall())


def test_every_sql_file_is_tested() -> None:
    assert sorted(p.name for p in SQL.glob("*.sql")) == sorted(FILES)


# roles.sql: test_roles.py; learned.sql: test_learning.py; dense.sql: test_dense.py
FILES = [
    "dense.sql",
    "coverage.sql",
    "tree_sizes.sql",
    "top_ngrams.sql",
    "disk_use.sql",
    "roles.sql",
    "learned.sql",
    "live_acceptance.sql",
    "part_acceptance.sql",
]


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


SERVED = [  # (store, day, figures): two requests on day 1, one on day 2, and a row without figures
    ("code", 1, {"steps": 10, "new_tokens": 25, "draft_tokens": 40, "accepted_tokens": 15, "accepted_static": 6,
                 "accepted_live": 12, "accepted_prompt": 3, "accepted_dense": 9}),  # dense: a part no migration knows
    ("code", 1, {"steps": 5, "new_tokens": 5, "draft_tokens": 8}),
    ("code", 2, {"steps": 5, "new_tokens": 10, "draft_tokens": 12, "accepted_tokens": 5, "accepted_live": 5,
                 "accepted_dense": 1}),
    ("code", 2, None),
    ("chat", 2, {"steps": 4, "new_tokens": 8, "draft_tokens": 9, "accepted_tokens": 4, "accepted_prompt": 4}),
]  # fmt: skip


@pytest.fixture()
def served(db_dsn: str) -> str:
    """Return a database whose learned log holds SERVED, each row on its day."""
    for store, day, figures in SERVED:
        append_learned(db_dsn, store, [[1, 2, 3]], stats=None if figures is None else [figures])
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE crest_learned SET created_at = %s WHERE id = (SELECT max(id) FROM crest_learned)",
                (datetime(2026, 11, day, 12, tzinfo=timezone.utc),),  # noon: the same day in any time zone
            )
    return db_dsn


def test_live_acceptance_counts_what_each_part_held(served: str) -> None:
    rows = {(r["store"], r["period"] and r["period"].day): r for r in _run(served, "live_acceptance.sql")}
    assert list(rows) == [("chat", None), ("chat", 2), ("code", None), ("code", 1), ("code", 2)]  # totals first
    code = rows[("code", None)]
    assert (code["requests"], code["new_tokens"], code["steps"], code["accepted_tokens"]) == (3, 40, 20, 20)
    assert (code["accepted_static"], code["accepted_live"], code["accepted_prompt"]) == (6, 17, 3)
    assert float(code["m"]) == 2.0 and float(code["accepted_per_step"]) == 1.0
    assert float(code["live_per_step"]) == pytest.approx(0.85) and float(code["live_share"]) == pytest.approx(0.425)
    assert float(code["static_share"]) == pytest.approx(0.15) and float(code["accepted_of_drafted"]) == 0.333
    day1 = rows[("code", 1)]
    assert (day1["requests"], day1["steps"], float(day1["m"]), float(day1["live_per_step"])) == (2, 15, 2.0, 0.8)
    assert float(rows[("chat", 2)]["prompt_share"]) == 0.5 and float(rows[("chat", 2)]["live_share"]) == 0.0


def test_part_acceptance_has_a_row_per_part_new_parts_included(served: str) -> None:
    found = _run(served, "part_acceptance.sql")
    rows = {(r["store"], r["period"] and r["period"].day, r["part"]): r for r in found}
    assert list(rows) == [
        ("chat", None, "prompt"), ("chat", 2, "prompt"),
        ("code", None, "dense"), ("code", None, "live"), ("code", None, "prompt"), ("code", None, "static"),
        ("code", 1, "dense"), ("code", 1, "live"), ("code", 1, "prompt"), ("code", 1, "static"),
        ("code", 2, "dense"), ("code", 2, "live"),
    ]  # fmt: skip  # totals first; a part with no accepted token in a period has no row
    dense = rows[("code", None, "dense")]
    assert (dense["requests"], dense["steps"], dense["new_tokens"], dense["accepted_tokens"]) == (3, 20, 40, 20)
    assert (dense["part_requests"], dense["part_tokens"]) == (2, 10)
    assert (float(dense["per_step"]), float(dense["share"]), float(dense["of_accepted"])) == (0.5, 0.25, 0.5)
    live = rows[("code", 1, "live")]
    assert (live["requests"], live["part_requests"], live["part_tokens"], float(live["per_step"])) == (2, 1, 12, 0.8)
    by_part = {part: r for (store, day, part), r in rows.items() if store == "code" and day is None}
    old = {r["store"]: r for r in _run(served, "live_acceptance.sql") if r["period"] is None}["code"]
    for part in ("static", "live", "prompt"):  # the two queries agree on the parts both know
        assert by_part[part]["part_tokens"] == old[f"accepted_{part}"]
        assert by_part[part]["per_step"] == old[f"{part}_per_step"] and by_part[part]["share"] == old[f"{part}_share"]


def test_queries_see_each_published_version_whole_while_versions_are_published(demo: str) -> None:
    """`crest db query` reads one snapshot: a version published mid-query is in all of its result or none of it.

    READ COMMITTED plans a statement over the partitions attached when each partitioned table is first locked and
    runs it on a later snapshot: a version published in between counted no rows (seen in a race test).
    """
    query, stop, published = read_query("coverage"), threading.Event(), [0]

    def publish_versions() -> None:
        while not stop.is_set():
            publish(demo, "demo", ROWS)
            published[0] += 1

    writer = threading.Thread(target=publish_versions, daemon=True)
    writer.start()
    seen, deadline = [], time.monotonic() + 120
    try:
        while published[0] < 20 and time.monotonic() < deadline and writer.is_alive():
            columns, rows = run_query(demo, query)
            seen.append(sorted(row[columns.index("kept")] for row in rows))
    finally:
        stop.set()
        writer.join(timeout=60)
    assert published[0] >= 20 and len(seen) > 20, (published, len(seen))
    assert all(kept == [1, 1, 2] for kept in seen), [kept for kept in seen if kept != [1, 1, 2]][:5]
