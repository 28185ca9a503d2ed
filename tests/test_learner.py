"""The SDK's `Learner` against a real Postgres: rows written as little-endian uint32 token bytes, one flush writes
what was queued, the queue is bounded (oldest dropped), a database that is down or hangs never stalls `learn()`
nor raises and costs only counted drops, writing resumes when it is back, and concurrent appends from threads
and processes lose nothing, the reader role may learn; what is queued when the interpreter exits is written.
A sequence's figures (`stats`) go into their columns, 0 where not given, and `accepted_<part>` of any part name
into the jsonb `accepted_parts` (non-zero ones); a batch without any writes only the columns of schema 0003, so
a database not upgraded yet still takes it.
"""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.errors import InvalidName
from crest_client.learner import STATS, DenseRows, Learner, split_stats
from psycopg import sql

from tests.fix_proxy import Proxy, Silent


def figures(dsn: str, store: str = "code") -> list[dict[str, int]]:
    """Return the store's learned rows' figures in id order: by `STATS` name, and `accepted_<part>` per stored part."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT {}, accepted_parts FROM crest_learned WHERE store = %s ORDER BY id").format(
                sql.SQL(", ").join(map(sql.Identifier, STATS))
            ),
            (store,),
        ).fetchall()
    return [dict(zip(STATS, row[:-1], strict=True)) | {f"accepted_{k}": v for k, v in row[-1].items()} for row in rows]


def learned(dsn: str, store: str = "code") -> list[tuple[list[int], int, int, str]]:
    """Return the store's learned rows in id order: (token ids, n_tokens, prompt_tokens, source)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tokens, n_tokens, prompt_tokens, source FROM crest_learned WHERE store = %s ORDER BY id", (store,)
        ).fetchall()
    return [(np.frombuffer(t, dtype="<u4").tolist(), n, p, s) for t, n, p, s in rows]


@pytest.fixture
def learner(db_dsn: str) -> Iterator[Learner]:
    """A learner of store `code` that writes only when flushed (or when 1000 tokens wait)."""
    with Learner(db_dsn, "code", flush_interval=60, flush_tokens=1000) as found:
        yield found


def test_rows_are_written_on_flush(learner: Learner, db_dsn: str) -> None:
    learner.learn([1, 2, 3], prompt_tokens=1)
    learner.learn(np.array([70_000, 5], dtype=np.int64), prompt_tokens=9)  # prompt_tokens clipped to the length
    learner.learn([])  # nothing to learn
    assert learned(db_dsn) == []  # nothing before the interval, the token threshold or a flush
    assert learner.flush(timeout=10)
    assert learned(db_dsn) == [([1, 2, 3], 3, 1, "sdk"), ([70_000, 5], 2, 2, "sdk")]
    assert learner.stats == {
        "queued": 0, "queued_tokens": 0, "written_rows": 2, "written_tokens": 5,
        "dropped_rows": 0, "dropped_tokens": 0, "errors": 0,
    }  # fmt: skip


FULL = {"steps": 4, "new_tokens": 9, "draft_tokens": 20, "accepted_tokens": 5, "accepted_static": 2,
        "accepted_live": 5, "accepted_prompt": 1, "accepted_dense": 3}  # fmt: skip  # dense: no migration knows it


def test_figures_are_written_with_their_rows(learner: Learner, db_dsn: str) -> None:
    learner.learn([1, 2, 3], stats=FULL)
    learner.learn([4, 5])  # none: every figure 0
    learner.learn([6], stats={"steps": 1, "new_tokens": 1, "accepted_live": 0, "accepted_draft_2": 7})  # others 0
    assert learner.flush(timeout=10)
    zero = dict.fromkeys(STATS, 0)
    assert figures(db_dsn) == [FULL, zero, zero | {"steps": 1, "new_tokens": 1, "accepted_draft_2": 7}]
    with psycopg.connect(db_dsn) as conn:  # a part's figure is a number in one jsonb object; zeros are left out
        rows = conn.execute("SELECT accepted_parts FROM crest_learned ORDER BY id").fetchall()
    assert [parts for (parts,) in rows] == [{"static": 2, "live": 5, "prompt": 1, "dense": 3}, {}, {"draft_2": 7}]


def test_dense_vectors_are_written_with_their_rows_and_misfits_left_out(learner: Learner, db_dsn: str) -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4) / 16  # [3, 4]: exact in float16
    learner.learn([1, 2, 3, 4], dense=DenseRows(7, 1, vectors))  # positions 1..3 of 4
    learner.learn([5, 6], stats={"steps": 1})  # none, in the same batch
    learner.learn([7, 8, 9], dense=DenseRows(7, 1, vectors))  # positions 1..3 of 3: the vectors are left out
    learner.learn([10, 11], dense=DenseRows(7, 0, vectors[0]))  # not [n, dims]: left out, the row kept
    assert learner.flush(timeout=10)
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute(
            "SELECT n_tokens, dense_version, dense_first, dense FROM crest_learned ORDER BY id"
        ).fetchall()
    assert [r[:3] for r in rows] == [(4, 7, 1), (2, None, None), (3, None, None), (2, None, None)]
    assert np.array_equal(np.frombuffer(rows[0][3], "<f2").reshape(3, 4), vectors)
    assert learner.stats["dropped_rows"] == 0 and learner.stats["written_rows"] == 4


def test_split_stats_names_the_request_figures_and_the_parts() -> None:
    assert split_stats(FULL) == ((4, 9, 20, 5), {"dense": 3, "live": 5, "prompt": 1, "static": 2})
    assert split_stats({"accepted_tokens": 3, "accepted_x": 0}) == ((0, 0, 0, 3), {})
    with pytest.raises(ValueError, match=r"unknown learned figures \['accepted_Live', 'tokens'\]"):
        split_stats({"accepted_Live": 1, "tokens": 2})


@pytest.mark.parametrize(
    "stats",
    [
        {"steps": 1, "other": 2},
        {"accepted_": 1},
        {"accepted_no-part": 1},
        {"steps": -1},
        {"accepted_live": -1},
        {"steps": 2**31},
        {"accepted_dense": 2**31},
        {"steps": "many"},
        {"accepted_live": None},
    ],
    ids=[
        "unknown-name",
        "empty-part",
        "bad-part-name",
        "negative",
        "negative-part",
        "over-31-bits",
        "part-over-31-bits",
        "not-a-number",
        "part-not-a-number",
    ],
)
def test_bad_figures_are_dropped_never_raised(learner: Learner, db_dsn: str, stats: Any) -> None:
    learner.learn([1, 2], stats=stats)
    learner.learn([4, 5], stats={"steps": 1})
    assert learner.flush(timeout=10)
    assert (learner.stats["dropped_rows"], learner.stats["errors"]) == (1, 0)
    assert [row[0] for row in learned(db_dsn)] == [[4, 5]]


def test_a_database_before_figures_takes_rows_without_them(empty_db: str) -> None:
    from crest.db import upgrade

    upgrade(empty_db, revision="0003")
    with Learner(empty_db, "code", flush_interval=60, flush_tokens=1000) as found:
        found.learn([1, 2, 3])
        assert found.flush(timeout=10)
        found.learn([4, 5], stats={"steps": 1})  # the columns are not there: this batch is dropped
        assert found.flush(timeout=10)
        stats = found.stats
    assert (stats["written_rows"], stats["dropped_rows"], stats["errors"]) == (1, 1, 1)
    assert learned(empty_db) == [([1, 2, 3], 3, 0, "sdk")]


@pytest.mark.parametrize(
    "trigger",
    [{"flush_interval": 0.05, "flush_tokens": 10_000}, {"flush_interval": 60, "flush_tokens": 4}],
    ids=["interval", "tokens"],
)
def test_written_without_flush(db_dsn: str, trigger: dict[str, Any]) -> None:
    with Learner(db_dsn, "code", source="srv-1", **trigger) as found:
        found.learn([7, 8, 9, 10, 11])
        deadline = time.monotonic() + 10
        while not learned(db_dsn):
            assert time.monotonic() < deadline, "nothing was written"
            time.sleep(0.02)
    assert learned(db_dsn) == [([7, 8, 9, 10, 11], 5, 0, "srv-1")]


@pytest.mark.parametrize(
    "ids",
    [[1, -2], [[1, 2], [3, 4]], [1.5, 2.0], ["a", "b"], [2**32], None],
    ids=["negative", "two-d", "floats", "strings", "over-32-bits", "none"],
)
def test_bad_input_is_dropped_never_raised(learner: Learner, db_dsn: str, ids: Any) -> None:
    learner.learn(ids)
    learner.learn([4, 5])
    assert learner.flush(timeout=10)
    assert learner.stats["dropped_rows"] == 1
    assert learned(db_dsn) == [([4, 5], 2, 0, "sdk")]


def test_the_queue_is_bounded_oldest_dropped(db_dsn: str) -> None:
    with Learner(db_dsn, "code", max_pending_tokens=10, flush_interval=60, flush_tokens=1000) as found:
        for k in range(4):
            found.learn([k] * 4)  # 16 tokens for room for 10: the two oldest go
        found.learn(list(range(11)))  # alone beyond the bound: dropped
        assert found.stats["queued_tokens"] == 8
        assert found.flush(timeout=10)
        assert (found.stats["dropped_rows"], found.stats["dropped_tokens"]) == (3, 19)
    assert [row[0] for row in learned(db_dsn)] == [[2] * 4, [3] * 4]


def test_database_down_drops_then_writes_again(db_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    proxy, dsn = Proxy.fronting(db_dsn)  # down: connections are refused
    caplog.set_level(logging.INFO, logger="crest_client.learner")
    with Learner(dsn, "code", flush_interval=0.01, flush_tokens=1000) as found:
        t0 = time.perf_counter()
        for k in range(200):
            found.learn([k, k + 1, k + 2])
        assert time.perf_counter() - t0 < 1.0  # learn() never waits for the database
        assert found.flush(timeout=20)
        stats = found.stats
        assert (stats["dropped_rows"], stats["written_rows"]) == (200, 0)
        assert stats["errors"] >= 1
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # one warning per outage
        proxy.up()
        try:
            found.learn([1, 2, 3])
            assert found.flush(timeout=20)
            assert found.stats["written_rows"] == 1
            assert "again" in caplog.records[-1].getMessage()
        finally:
            proxy.down()
    assert learned(db_dsn) == [([1, 2, 3], 3, 0, "sdk")]


def test_a_hanging_database_never_stalls_learn() -> None:
    silent = Silent()
    try:
        found = Learner(f"postgresql://u@127.0.0.1:{silent.port}/db", "code", flush_interval=0.01, connect_timeout=1)
        try:
            slowest = 0.0
            deadline = time.monotonic() + 1.5  # the writer is stuck connecting for most of this
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                found.learn([1, 2, 3, 4])
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.001)
            assert slowest < 0.1
            assert found.flush(timeout=20)
            stats = found.stats
            assert stats["dropped_rows"] > 0 and stats["written_rows"] == 0 and stats["errors"] >= 1
        finally:
            found.close()
    finally:
        silent.close()


def test_concurrent_learn_from_threads_loses_nothing(db_dsn: str) -> None:
    with Learner(db_dsn, "code", flush_interval=0.005, flush_tokens=50) as found:

        def send(worker: int) -> None:
            for k in range(150):
                found.learn([worker, k, worker * 1000 + k], prompt_tokens=1)

        threads = [threading.Thread(target=send, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert found.flush(timeout=30)
        assert found.stats["written_rows"] == 900 and found.stats["dropped_rows"] == 0
    rows = learned(db_dsn)
    assert sorted(tuple(r[0]) for r in rows) == sorted((w, k, w * 1000 + k) for w in range(6) for k in range(150))


def _learn_in_process(dsn: str, worker: int) -> None:
    with Learner(dsn, "code", source=f"p{worker}", flush_interval=0.005, flush_tokens=40) as found:
        for k in range(100):
            found.learn([worker, k])
        assert found.flush(timeout=30)


def test_concurrent_learners_in_processes_lose_nothing(db_dsn: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_learn_in_process, args=(db_dsn, w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = learned(db_dsn)
    assert sorted((r[3], tuple(r[0])) for r in rows) == sorted((f"p{w}", (w, k)) for w in range(3) for k in range(100))


def test_closed_learner_drops_and_stores_are_checked(db_dsn: str) -> None:
    found = Learner(db_dsn, "code", flush_interval=60)
    found.learn([1, 2])
    found.close()
    found.learn([3, 4])
    assert found.stats["written_rows"] == 1 and found.stats["dropped_rows"] == 1
    assert learned(db_dsn) == [([1, 2], 2, 0, "sdk")]
    with pytest.raises(InvalidName):
        Learner(db_dsn, "no such store")


def test_what_is_queued_at_exit_is_written(db_dsn: str) -> None:
    script = (
        "import sys\nfrom crest_client.learner import Learner\n"
        "Learner(sys.argv[1], 'code', flush_interval=60).learn([5, 6, 7])\n"  # never flushed nor closed
    )
    subprocess.run([sys.executable, "-c", script, db_dsn], check=True, timeout=60)
    assert learned(db_dsn) == [([5, 6, 7], 3, 0, "sdk")]


def test_the_reader_role_may_learn(db_dsn: str) -> None:
    from crest.db.roles import create_roles

    tag, password = uuid.uuid4().hex[:8], uuid.uuid4().hex
    reader, writer = f"crest_r_{tag}", f"crest_w_{tag}"
    create_roles(db_dsn, reader=reader, writer=writer, reader_password=password, writer_password=password)
    info = psycopg.conninfo.conninfo_to_dict(db_dsn) | {"user": reader, "password": password}
    try:
        with Learner(psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()}), "code") as found:
            found.learn([1, 2, 3], prompt_tokens=2)
            found.learn([4, 5], stats={"steps": 1, "accepted_live": 1, "accepted_dense": 2})
            assert found.flush(timeout=10)
            assert found.stats["written_rows"] == 2 and found.stats["errors"] == 0
        assert learned(db_dsn) == [([1, 2, 3], 3, 2, "sdk"), ([4, 5], 2, 0, "sdk")]
        assert figures(db_dsn) == [dict.fromkeys(STATS, 0), dict.fromkeys(STATS, 0) | {
            "steps": 1, "accepted_live": 1, "accepted_dense": 2}]  # fmt: skip
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as conn:  # roles are cluster-wide: remove them
            for role in (reader, writer):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_connection_lost_between_writes_loses_no_batch(learner: Learner, db_dsn: str) -> None:
    learner.learn([1, 2, 3])
    assert learner.flush(timeout=10) and learner.stats["written_rows"] == 1
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # the server ends the learner's connection (a restart)
        ended = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()
    assert ended == [(True,)]
    learner.learn([4, 5])
    assert learner.flush(timeout=30)
    assert (learner.stats["written_rows"], learner.stats["dropped_rows"]) == (2, 0)  # written on a fresh connection
    assert learned(db_dsn) == [([1, 2, 3], 3, 0, "sdk"), ([4, 5], 2, 0, "sdk")]
