"""A real failover while `crest serve`'s engine learns: the primary is stopped and its streaming replica promoted.

A pair of its own (the session's pair in tests/fix_replica.py stays a pair): the engine reads from both servers
(the replica first) and writes its learned rows to the read-write one of both (`target_session_attrs`). Rows
learned before the switch are on the promoted server; rows learned while neither server takes writes (the
primary stopped, the replica not yet promoted) are kept and written there once it is promoted, as are rows learned
after it; none is lost or written twice, and the store drafts from the promoted server on the connection it had.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from psycopg import sql

from tests.fix_replica import ReplicaPair, postgres_bin, run_as_server, start_pair
from tests.fix_require import require
from tests.test_replica import CONTEXTS, VOCAB, both, publish, server_of_clients, version_of

pytest_plugins = ["tests.fix_replica"]


@pytest.fixture()
def own_pair() -> Iterator[tuple[ReplicaPair, str]]:
    """Yield a fresh primary and replica (this test promotes the replica) and a migrated, replayed database."""
    from crest.db.versions import upgrade

    bindir = postgres_bin()
    if not (bindir / "pg_basebackup").exists():
        require("replica", f"no pg_basebackup next to the embedded PostgreSQL server in {bindir}")
    root = Path(tempfile.mkdtemp(prefix="crest-failover-"))
    pair = None
    try:
        pair = start_pair(root, bindir)
        name = f"crest_fail_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        upgrade(pair.primary.dsn(name))
        pair.wait_replayed()
        yield pair, name
    finally:
        for server in (pair.replica, pair.primary) if pair else ():
            if server.running:
                server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def learned_rows(dsn: str) -> list[tuple[int, list[int]]]:
    """Return (prompt tokens kept, tokens) of store demo's learned rows on the server of `dsn`."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT prompt_tokens, tokens FROM crest_learned WHERE store = 'demo' ORDER BY id")
        return [(int(kept), np.frombuffer(tokens, dtype="<u4").tolist()) for kept, tokens in rows]


def serve(engine: Any, marks: range) -> None:
    """Serve one request per mark (its prompt ends with the mark: its learned row says which it was)."""
    futures = [
        engine.submit(engine.request([3, 4, 5, m], drafter="crest", store="demo", prediction=None, max_tokens=6))
        for m in marks
    ]
    for future in futures:
        assert not future.result(timeout=120).cancelled


def queued(learner: Any, rows: int, timeout: float = 60.0) -> None:
    """Wait until `rows` rows wait in the learner or were dropped (the engine teaches it once an answer is out)."""
    deadline = time.monotonic() + timeout
    while learner.stats["queued"] + learner.stats["dropped_rows"] < rows:
        assert time.monotonic() < deadline, learner.stats
        time.sleep(0.01)


def written(engine: Any, rows: int, timeout: float = 120.0) -> dict[str, int]:
    """Wait until the store's learner has written `rows` rows in all (flushing); return its counters."""
    learner = engine.learner("demo")
    deadline = time.monotonic() + timeout
    while learner.stats["written_rows"] + learner.stats["dropped_rows"] < rows:
        assert time.monotonic() < deadline, learner.stats
        learner.flush(timeout=5)
    return dict(learner.stats)


def test_promoting_the_replica_while_the_engine_learns_loses_no_row_and_drafting_goes_on(
    own_pair: tuple[ReplicaPair, str],
) -> None:
    from crest.decoding.sizing import CostModel
    from crest.drafting.hub import LearnOptions
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler
    from tests.fix_models import IdTokenizer, tiny_model

    pair, name = own_pair
    publish(pair.primary.dsn(name), "demo", 1)
    pair.wait_replayed()
    ports = f"{pair.primary.port},{pair.replica.port}"
    writes = f"host=127.0.0.1,127.0.0.1 port={ports} user=postgres dbname={name} target_session_attrs=read-write"
    sched = Scheduler(tiny_model("llama", vocab=VOCAB), IdTokenizer(), cost=CostModel([1, 64], [1.0, 1.0]))
    learning = LearnOptions(refresh_interval=0, flush_interval=0.05, recent=None)
    engine = Engine(sched, IdTokenizer(), model_name="tiny", store="demo", drafter="crest", fingerprint="fp-a",
                    dsn=writes, read_dsn=both(pair, name, first="replica"), learning=learning)  # fmt: skip
    engine.start()
    try:
        store = engine.store("demo")
        assert version_of(store.draft(CONTEXTS[0])) == 1
        assert server_of_clients(pair, name) == {"primary": 0, "replica": 1}  # drafting reads the replica
        serve(engine, range(500, 503))
        assert written(engine, 3)["written_rows"] == 3

        pair.wait_replayed()
        pair.primary.stop("fast")  # a switchover: the primary sends the standby all it wrote, then stops
        serve(engine, range(503, 506))  # learned while no server takes writes: kept for the promoted one
        learner = engine.learner("demo")
        assert learner is not None
        queued(learner, 3)
        assert not learner.flush(timeout=0.5)  # nothing writable yet: kept, neither written nor dropped
        assert (learner.stats["written_rows"], learner.stats["dropped_rows"]) == (3, 0), learner.stats
        run_as_server(pair.replica.bindir / "pg_ctl", "-D", str(pair.replica.pgdata), "-w", "-t", "60", "promote")
        serve(engine, range(506, 509))  # learned after the switch: written to the promoted server
        stats = written(engine, 9)
        assert stats["written_rows"] == 9 and stats["dropped_rows"] == 0, stats

        rows = learned_rows(pair.replica.dsn(name))  # the promoted server holds every row, each once
        marks = sorted(tokens[kept - 1] for kept, tokens in rows)
        assert marks == list(range(500, 509)), rows

        store.clear_cache()  # drafting goes on, from the promoted server, on the connection it had
        assert version_of(store.draft(CONTEXTS[0])) == 1, store.stats
        assert server_of_clients(pair, name) == {"replica": 1}
    finally:
        engine.stop(timeout=30.0)
