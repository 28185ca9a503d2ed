"""The SDK's `Learner` against a real Postgres: rows written as little-endian uint32 token bytes, one flush writes
what was queued, the queue is bounded (oldest dropped), a database that is down, stopped or hangs never stalls
`learn()` nor raises: what was learned meanwhile is kept (within the bound) and written once it is back, each row
exactly once, also when the connection dies after a COMMIT was sent (the COMMIT done or lost), and `close()` on a
dead database ends within its timeout; concurrent appends from threads and processes lose nothing, the reader role
may learn; what is queued when the interpreter exits is written. A sequence's figures (`stats`) go into their
columns, 0 where not given, and `accepted_<part>` of any part name into the jsonb `accepted_parts` (non-zero ones);
a batch without any writes only the columns of schema 0003, so a database not upgraded yet still takes it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import multiprocessing
import socket
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

from tests.fix_db import OwnServer
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


def test_database_down_keeps_rows_oldest_dropped_beyond_the_bound_and_writes_them_once_back(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy, dsn = Proxy.fronting(db_dsn)  # down: connections are refused
    caplog.set_level(logging.INFO, logger="crest_client.learner")
    with Learner(dsn, "code", max_pending_tokens=450, flush_interval=0.01, flush_tokens=1000) as found:
        t0 = time.perf_counter()
        for k in range(200):
            found.learn([k, k + 1, k + 2])  # 600 tokens for room for 450: the 50 oldest rows go
        assert time.perf_counter() - t0 < 1.0  # learn() never waits for the database
        assert not found.flush(timeout=0.5)  # nothing can be written: the flush times out
        stats = found.stats
        assert stats["written_rows"] == 0 and stats["errors"] >= 1, stats
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # one warning per outage
        proxy.up()
        try:
            assert found.flush(timeout=30)
            stats = found.stats
            assert (stats["written_rows"], stats["dropped_rows"], stats["dropped_tokens"]) == (150, 50, 150), stats
            assert "again" in caplog.records[-1].getMessage()
        finally:
            proxy.down()
    assert [row[0] for row in learned(db_dsn)] == [[k, k + 1, k + 2] for k in range(50, 200)]  # each once, in order


def test_a_hanging_database_never_stalls_learn_nor_close() -> None:
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
            assert not found.flush(timeout=1.5)  # kept, not written: the flush times out
            stats = found.stats
            assert stats["queued"] > 0 and stats["written_rows"] == stats["dropped_rows"] == 0 and stats["errors"] >= 1
        finally:
            found.close(timeout=0.5)  # tries for half a second, then drops what is left
        assert found.flush(timeout=30)  # the writer ends (it is not stuck): nothing is queued any more
        stats = found.stats
        assert stats["queued"] == stats["written_rows"] == 0 and stats["dropped_rows"] > 0, stats
    finally:
        silent.close()


@pytest.fixture(scope="module")
def own_server() -> Iterator[OwnServer]:
    """A private server (the session's is shared with other tests: this one is stopped)."""
    from crest.db import upgrade

    server = OwnServer(prefix="crest-learner-pg-")
    upgrade(server.dsn)
    try:
        yield server
    finally:
        server.close()


def test_rows_learned_while_the_server_is_stopped_are_written_once_it_is_back(own_server: OwnServer) -> None:
    with Learner(own_server.dsn, "stopped", flush_interval=0.05, retry_interval=0.05, max_retry_interval=0.5) as found:
        found.learn([1, 2, 3])
        assert found.flush(timeout=30) and found.stats["written_rows"] == 1  # its connection is open
        own_server.stop()
        try:
            for k in range(10, 40):
                found.learn([k, k + 1])
            assert not found.flush(timeout=1.0)  # kept, not written, not dropped
            assert found.stats["queued"] == 30 and found.stats["dropped_rows"] == 0
        finally:
            own_server.start()
        assert found.flush(timeout=60)
        stats = found.stats
        assert (stats["written_rows"], stats["dropped_rows"], stats["queued"]) == (31, 0, 0), stats
    assert [row[0] for row in learned(own_server.dsn, "stopped")] == [[1, 2, 3]] + [[k, k + 1] for k in range(10, 40)]


class CommitCutter:
    """A TCP front for the test Postgres's unix socket that cuts the first connection that sends a COMMIT.

    `arrives`: the COMMIT reaches the server, which commits, and its answer is lost (both sockets closed).
    Otherwise the COMMIT itself is lost: the server sees its client vanish in the middle of the transaction.
    """

    def __init__(self, dsn: str, *, arrives: bool) -> None:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        self.target = glob.glob(f"{info['host']}/.s.PGSQL.*")[0]
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.dsn = f"postgresql://{info['user']}@127.0.0.1:{self.listener.getsockname()[1]}/{info['dbname']}"
        self.arrives = arrives
        self.armed = True
        self.cut = threading.Event()  # set once a COMMIT was cut
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            self._end(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target)
            self.sockets += [client, upstream]
            answer_lost = threading.Event()  # the server's next bytes (the COMMIT's answer) are not passed on
            threading.Thread(target=self._to_server, args=(client, upstream, answer_lost), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, answer_lost), daemon=True).start()

    def _to_server(self, client: socket.socket, upstream: socket.socket, answer_lost: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if self.armed and b"COMMIT" in data:
                    self.armed = False
                    if self.arrives:
                        answer_lost.set()
                        upstream.sendall(data)
                    else:
                        self._end(client, upstream)
                        self.cut.set()
                    continue
                upstream.sendall(data)
        except OSError:
            pass
        self._end(client, upstream)

    def _to_client(self, upstream: socket.socket, client: socket.socket, answer_lost: threading.Event) -> None:
        try:
            while data := upstream.recv(65536):
                if answer_lost.is_set():  # the server answered the COMMIT: the client never hears it
                    self._end(client, upstream)
                    self.cut.set()
                    return
                client.sendall(data)
        except OSError:
            pass
        self._end(client, upstream)

    @staticmethod
    def _end(*sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.mark.parametrize("arrives", [True, False], ids=["commit-done-answer-lost", "commit-lost"])
def test_a_batch_whose_commit_got_no_answer_is_written_exactly_once(db_dsn: str, arrives: bool) -> None:
    cutter = CommitCutter(db_dsn, arrives=arrives)
    try:
        with Learner(cutter.dsn, "code", flush_interval=60, flush_tokens=1000, retry_interval=0.05) as found:
            for k in range(5):
                found.learn([k, 7, 7])
            assert found.flush(timeout=60)  # the cut, then the transaction's fate asked on a fresh connection
            assert cutter.cut.is_set()
            stats = found.stats
            assert (stats["written_rows"], stats["dropped_rows"], stats["errors"]) == (5, 0, 1), stats
            found.learn([9, 9])  # and the learner writes on
            assert found.flush(timeout=30)
    finally:
        cutter.close()
    assert [row[0] for row in learned(db_dsn)] == [[k, 7, 7] for k in range(5)] + [[9, 9]]


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
