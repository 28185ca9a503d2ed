"""Lookups from a streaming replica: a primary and a hot standby (two embedded PostgreSQL 18 servers).

A store published on the primary is drafted from the replica once replayed, and never half: a replica that has
not replayed a publication still shows the previous version whole. DSNs that name both servers pick the one
their `target_session_attrs` asks for, and when the replica goes away (stopped, or hung) lookups miss for a
short while, never raise or hang, and then draft again from the primary, generation's output unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import psycopg
import pytest
from crest_client import Store
from crest_client.codec import TokenTable, encode_tree, token_width
from crest_client.keyfilter import KeyFilter, hash_keys

from crest import db
from tests.fix_replica import ReplicaPair, free_port

pytest_plugins = ["tests.fix_replica"]

VOCAB = 1000
KEYS = [(5,), (4, 5), (3, 4, 5), (9, 9)]
CONTEXTS = [[1, 3, 4, 5], [2, 9, 9]]  # drafted from (3, 4, 5) and (9, 9)
CONNECT_TIMEOUT = 8  # seconds: what a lookup would wait for a hung server if it waited for one


def chain(first: int, size: int = 4) -> bytes:
    """Return the blob of a chain tree of tokens first, first + 1, ..."""
    tokens = np.arange(first, first + size, dtype=np.int64)
    return encode_tree(tokens, np.arange(-1, size - 1, dtype=np.int32), np.arange(size, 0, -1), vocab_size=VOCAB)


def publish(dsn: str, name: str, version: int) -> int:
    """Publish a version of `name` whose trees start at token 100 * version + 10 * (key index)."""
    build = db.begin_build(
        dsn, name, fingerprint="fp-a", tokenizer="test", vocab_size=VOCAB, token_width=token_width(VOCAB),
        params={"max_n": 3},
    )  # fmt: skip
    try:
        build.copy_vocab((i, f"<{i}>") for i in range(VOCAB))
        dtype = f">u{token_width(VOCAB)}"
        rows = [
            (np.asarray(k, dtype=dtype).tobytes(), len(k), 7, chain(100 * version + 10 * i)) for i, k in enumerate(KEYS)
        ]
        build.copy_ngrams(rows)
        hashes = np.concatenate([hash_keys(np.array([k])) for k in KEYS])
        build.write_store_data(TokenTable(np.arange(VOCAB)).to_bytes(), KeyFilter.build(hashes).to_bytes())
        build.finish_tables()
        build.publish({})
        return build.store_id
    finally:
        build.close()


def version_of(draft: Any) -> int | None:
    """Return the version a draft comes from (None for a miss); fail on a tree no version has."""
    if draft is None:
        return None
    first = int(draft.tokens[0])
    assert draft.tokens.tolist() == list(range(first, first + 4)), f"not a whole tree: {draft.tokens.tolist()}"
    return first // 100


def server_of_clients(pair: ReplicaPair, dbname: str) -> dict[str, int]:
    """Return how many SDK connections to `dbname` each running server holds."""
    found = {}
    for role, server in (("primary", pair.primary), ("replica", pair.replica)):
        if not server.running:
            continue
        with psycopg.connect(server.dsn(dbname), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'crest-client' AND datname = %s",
                (dbname,),
            ).fetchone()
        found[role] = int(row[0]) if row else 0
    return found


def both(pair: ReplicaPair, dbname: str, *, first: str = "replica", extra: str = "") -> str:
    """Return a keyword DSN naming both servers, `first` first."""
    ports = (pair.replica.port, pair.primary.port) if first == "replica" else (pair.primary.port, pair.replica.port)
    return f"host=127.0.0.1,127.0.0.1 port={ports[0]},{ports[1]} user=postgres dbname={dbname} {extra}".strip()


def test_replica_drafts_what_the_primary_published(replica_pair: ReplicaPair, replicated_db: str) -> None:
    publish(replica_pair.primary.dsn(replicated_db), "demo", 1)
    replica_pair.wait_replayed()
    with (
        Store.connect(replica_pair.primary.dsn(replicated_db), "demo", cache_size=0, timeout=2.0) as primary,
        Store.connect(replica_pair.replica.dsn(replicated_db), "demo", cache_size=0, timeout=2.0) as replica,
    ):
        for context in CONTEXTS:
            want, got = primary.draft(context), replica.draft(context)
            assert want is not None and got is not None
            assert got.tokens.tolist() == want.tokens.tolist() and got.n == want.n
        assert replica.draft_many(CONTEXTS)[1] is not None
    with psycopg.connect(replica_pair.replica.dsn(replicated_db)) as conn:
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)


@pytest.mark.parametrize(
    ("first", "extra", "expected"),
    [
        ("replica", "connect_timeout=2", "replica"),
        ("replica", "uri", "replica"),
        ("replica", "target_session_attrs=read-write", "primary"),
        ("primary", "target_session_attrs=standby", "replica"),
        ("primary", "target_session_attrs=prefer-standby", "replica"),
        ("primary", "load_balance_hosts=random target_session_attrs=read-only", "replica"),
    ],
    ids=["keywords", "uri", "read-write", "standby", "prefer-standby", "load-balanced-read-only"],
)
def test_multi_host_dsn_reaches_the_server_it_asks_for(
    replica_pair: ReplicaPair, replicated_db: str, first: str, extra: str, expected: str
) -> None:
    publish(replica_pair.primary.dsn(replicated_db), "demo", 1)
    replica_pair.wait_replayed()
    if extra == "uri":
        r, p = replica_pair.replica.port, replica_pair.primary.port
        dsn = f"postgresql://postgres@127.0.0.1:{r},127.0.0.1:{p}/{replicated_db}?connect_timeout=2"
    else:
        dsn = both(replica_pair, replicated_db, first=first, extra=extra)
    with Store.connect(dsn, "demo", cache_size=0, timeout=2.0) as handle:
        assert version_of(handle.draft(CONTEXTS[0])) == 1
        clients = server_of_clients(replica_pair, replicated_db)
    assert clients[expected] >= 1 and sum(clients.values()) == clients[expected], clients


def _resume(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _server_pids(pgdata: Path) -> list[int]:
    postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
    return [postmaster.pid, *(child.pid for child in postmaster.children(recursive=True))]


@pytest.mark.parametrize("how", ["stopped", "hung"])
def test_lookups_move_to_the_primary_when_the_replica_goes_away(
    replica_pair: ReplicaPair, replicated_db: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(replica_pair.primary.dsn(replicated_db), "demo", 1)
    replica_pair.wait_replayed()
    # a hung server accepts TCP connections and never answers: each attempt waits for connect_timeout
    dsn = both(replica_pair, replicated_db, first="replica", extra=f"connect_timeout={CONNECT_TIMEOUT}")
    calls: list[tuple[float, float, int | None]] = []  # (start, seconds, version)
    errors: list[BaseException] = []
    stop = threading.Event()

    connecting: list[str] = []  # the thread of every connection attempt (the pool's workers make them)
    pooled = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def attempt(cls: Any, *args: Any, **kw: Any) -> Any:
        connecting.append(threading.current_thread().name)
        return pooled(cls, *args, **kw)

    with Store.connect(dsn, "demo", cache_size=0, timeout=0.1) as handle:
        assert server_of_clients(replica_pair, replicated_db)["replica"] >= 1
        monkeypatch.setattr(psycopg.Connection, "connect", classmethod(attempt))
        waits: list[int] = []  # failures and timeouts each lookup counted: each one wait of its 0.1 s at most

        def lookups() -> None:
            while not stop.is_set():
                start, before = time.monotonic(), handle.stats["timeouts"] + handle.stats["errors"]
                try:
                    found = handle.draft(CONTEXTS[0])
                except BaseException as exc:  # what generation would see
                    errors.append(exc)
                    return
                calls.append((start, time.monotonic() - start, version_of(found)))
                waits.append(handle.stats["timeouts"] + handle.stats["errors"] - before)

        worker = threading.Thread(target=lookups, daemon=True)
        worker.start()
        hung: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while len(calls) < 20 and not errors:  # lookups drafted from the replica before it goes away
                assert time.monotonic() < deadline and worker.is_alive(), "the lookups did not start"
                time.sleep(0.01)
            up = time.monotonic()
            if how == "stopped":
                replica_pair.replica.stop("immediate")
            else:
                hung = _server_pids(replica_pair.replica.pgdata)
                for pid in hung:
                    os.kill(pid, signal.SIGSTOP)
            gone = time.monotonic()  # lookups that start later find the replica gone
            deadline = gone + 60.0 + 2 * CONNECT_TIMEOUT  # the pool's new connection tries the lost server first
            while time.monotonic() < deadline and not errors:
                recent = [v for start, _, v in calls if start > gone][-20:]
                if len(recent) == 20 and all(v == 1 for v in recent):
                    break
                time.sleep(0.05)
        finally:
            stop.set()
            worker.join(5.0)
            _resume(hung)
        if hung:
            replica_pair.replica.stop("immediate")
        on_primary = server_of_clients(replica_pair, replicated_db)["primary"]

    assert not errors, f"a lookup raised: {errors[0]!r}"
    before = [v for start, seconds, v in calls if start + seconds < up]
    after = [v for start, seconds, v in calls if start + seconds >= up]
    assert before and all(v == 1 for v in before), "the replica drafted before it went away"
    assert None in after, "lookups on the lost replica missed"
    assert after[-20:] == [1] * 20, "lookups drafted again, from the primary"
    assert on_primary >= 1, "the pool's new connection went to the primary"
    # what the SDK promises, not the machine's speed: a lookup waits at most once (its timeout), and never for a
    # connection to the lost server (up to connect_timeout): the pool's workers connect, never a lookup's thread
    assert set(waits) <= {0, 1} and sum(waits) > 0, f"failures per lookup: {waits}"
    assert connecting and worker.name not in connecting, connecting


def test_generation_output_is_unchanged_when_the_replica_dies_mid_generation(
    replica_pair: ReplicaPair, replicated_db: str, tmp_path: Path
) -> None:
    from crest.bench.generate import generate_plain
    from crest.config import IngestOptions
    from crest.decoding.generator import SpeculativeGenerator
    from crest.drafters.registry import make_drafter
    from crest.ingest.pipeline import ingest
    from tests.fix_corpus import make_word_tokenizer
    from tests.fix_models import IdTokenizer, tiny_model

    model = tiny_model("llama", vocab=64)
    prompt = [3, 9, 4, 12, 7, 7, 30, 2, 5, 11]
    want = generate_plain(model, IdTokenizer(), prompt, max_new_tokens=40).output_token_ids
    names = ["[UNK]", "[EOS]", *(f"t{i}" for i in range(2, 64))]  # token i is the word names[i]
    tokenizer = make_word_tokenizer(tmp_path / "tok", names[2:])
    corpus = tmp_path / "gen.jsonl"
    corpus.write_text(json.dumps({"text": " ".join(names[t] for t in prompt + want)}) + "\n")
    primary = replica_pair.primary.dsn(replicated_db)
    ingest([str(corpus)], store="gen", tokenizer=str(tokenizer), dsn=primary, options=IngestOptions(top_t=1000))
    replica_pair.wait_replayed()

    dsn = both(replica_pair, replicated_db, extra="connect_timeout=3")
    store = Store.connect(dsn, "gen", cache_size=0, timeout=0.5)  # generous: the machine may be loaded
    drafter = make_drafter("crest", store=store)
    assert drafter is not None and store.draft(prompt) is not None  # the replica answers: the pool is warm
    calls = 0

    class ReplicaDies:
        """The crest drafter; the replica is stopped before its third draft, and its fifth waits (with a deadline)
        until the pool has a connection to the primary, so drafting resumes whatever the machine's speed."""

        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                replica_pair.replica.stop("immediate")
            if calls == 5:
                deadline = time.monotonic() + 60
                while store.draft(prompt) is None:  # the prompt drafts (asserted above) once connected
                    assert time.monotonic() < deadline, "the store never drafted from the primary"
                    time.sleep(0.05)
            assert drafter is not None
            return drafter.draft(context_ids, max_nodes)

    generator = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=4)
    try:
        result = generator.generate(prompt, drafter=ReplicaDies(), max_new_tokens=40)
    finally:
        store.close()
    assert result.output_token_ids == want
    assert calls > 5 and not replica_pair.replica.running, "the replica died mid-generation"
    assert max(result.accepted_per_step[:2]) > 1, "the replica's drafts were accepted"
    assert max(result.accepted_per_step[4:]) > 1, "the primary's drafts were accepted after the replica died"


def test_a_new_version_shows_on_the_replica_once_replayed(replica_pair: ReplicaPair, replicated_db: str) -> None:
    primary = replica_pair.primary.dsn(replicated_db)
    publish(primary, "demo", 1)
    replica_pair.wait_replayed()
    replica = replica_pair.replica.dsn(replicated_db)
    with (
        Store.connect(replica, "demo", cache_size=0, timeout=2.0, refresh_interval=0.0) as reader,
        psycopg.connect(replica, autocommit=True) as standby,
    ):
        standby.execute("SELECT pg_wal_replay_pause()")
        try:
            publish(primary, "demo", 2)
            for _ in range(20):  # the replica has not replayed it: the old version, whole
                assert [version_of(d) for d in reader.draft_many(CONTEXTS)] == [1, 1]
        finally:
            standby.execute("SELECT pg_wal_replay_resume()")
        replica_pair.wait_replayed()
        assert [version_of(d) for d in reader.draft_many(CONTEXTS)] == [2, 2]
    with Store.connect(primary, "demo", cache_size=0, timeout=2.0) as direct:
        assert direct.info.id == reader.info.id


def test_replica_readers_never_see_half_a_version(replica_pair: ReplicaPair, replicated_db: str) -> None:
    primary = replica_pair.primary.dsn(replicated_db)
    publish(primary, "demo", 1)
    replica_pair.wait_replayed()
    seen: list[list[int | None]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    reader = Store.connect(
        replica_pair.replica.dsn(replicated_db), "demo", cache_size=0, timeout=2.0, refresh_interval=0.0
    )

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append([version_of(d) for d in reader.draft_many(CONTEXTS)])
            except BaseException as exc:
                errors.append(exc)
                return

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    try:
        for version in range(2, 7):
            publish(primary, "demo", version)  # the previous version's tables are dropped
            time.sleep(0.1)
        replica_pair.wait_replayed()
        deadline = time.monotonic() + 60
        while not seen or seen[-1] != [6, 6]:  # the reader reads the last version
            assert time.monotonic() < deadline and worker.is_alive(), "the reader never read version 6"
            time.sleep(0.02)
    finally:
        stop.set()
        worker.join(10.0)
        reader.close()
    assert not errors, f"a lookup raised: {errors[0]!r}"
    whole = [s for s in seen if s != [None, None]]
    assert all(a == b for a, b in whole), [s for s in whole if s[0] != s[1]][:3]  # one statement, one version
    versions = [s[0] for s in whole]
    assert versions == sorted(versions), "a reader went back to an older version"  # type: ignore[type-var]
    assert versions[0] == 1 and versions[-1] == 6 and len(set(versions)) >= 2


def test_engine_reads_from_the_read_dsn_and_keeps_dsn_for_writes(replica_pair: ReplicaPair, replicated_db: str) -> None:
    from crest.decoding.sizing import CostModel
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler
    from tests.fix_models import IdTokenizer, tiny_model

    publish(replica_pair.primary.dsn(replicated_db), "demo", 1)
    replica_pair.wait_replayed()
    sched = Scheduler(tiny_model("llama", vocab=64), IdTokenizer(), cost=CostModel([1, 64], [1.0, 1.0]))
    engine = Engine(
        sched, IdTokenizer(), model_name="tiny", store="demo", drafter="crest", fingerprint="fp-a",
        dsn=replica_pair.primary.dsn(replicated_db), read_dsn=replica_pair.replica.dsn(replicated_db),
    )  # fmt: skip
    try:
        store = engine.store("demo")
        assert version_of(store.draft(CONTEXTS[0])) == 1
        assert server_of_clients(replica_pair, replicated_db) == {"primary": 0, "replica": 1}
        assert engine.hub.dsn == replica_pair.primary.dsn(replicated_db)  # learning writes there
    finally:
        engine.stop(timeout=5.0)


def test_bench_lookup_reads_the_replica_without_migrating_it(
    replica_pair: ReplicaPair,
    replicated_db: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from crest.cli import main

    publish(replica_pair.primary.dsn(replicated_db), "demo", 1)
    replica_pair.wait_replayed()
    down = f"host=127.0.0.1 port={free_port()} user=postgres dbname={replicated_db} connect_timeout=1"
    monkeypatch.setenv("CREST_DATABASE_URL", down)  # nothing answers there: every read goes to the replica
    argv = ["crest", "bench", "lookup", "--store", "demo", "--samples", "4", "--json"]
    for read_dsn, code, says in [
        (replica_pair.replica.dsn(replicated_db), 0, ""),
        ("host=a,b port=1,2,3", 2, "the DSN names 2 hosts but 3 ports"),
    ]:
        monkeypatch.setenv("CREST_READ_DATABASE_URL", read_dsn)
        monkeypatch.setattr("sys.argv", argv)
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main()
        out, err = capsys.readouterr()
        assert int(done.value.code or 0) == code, err
        assert says in err and len(err.strip().splitlines()) <= 1
        if code == 0:
            assert json.loads(out.splitlines()[-1])
