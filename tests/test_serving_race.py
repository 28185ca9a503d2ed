"""Two `crest serve` processes on one database race to refresh the live tier of the store they both learn into.

Each server is a real subprocess (a tiny random llama over the SmolLM2 tokenizer, in float64) with its own
`Refresher` thread every 0.25 s, shorter than a refresh takes, on one real PostgreSQL database and one static
store. The rounds take turns: one server serves a new prompt twice (a live tier keeps the n-grams seen at least
twice) and learns it; the other then serves the same prompt, gives the same text and drafts it from the live
tier (its learned row counts the accepted tokens the live part held). A trigger the test installs notes every
publication of a version with what the version held at that moment, so the test sees every live version ever
published, those retired and dropped since included: each refresh round (the newest learned row a version
was built through) is published once and in order, the servers' metrics count the same publications, every
version was whole when published (its partitions attached, all its rows and vocabulary there, its token table
written), the published ones stay whole while the servers race, and after a clean-up nothing else is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest

from crest import db
from crest.bench.server_process import ServerProcess
from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from tests.fix_serve_processes import refresh_counts, serve_processes

pytest_plugins = ["tests.fix_corpus", "tests.fix_serve_processes"]

T = TypeVar("T")

CORPUS = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20
PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, item):", "for i in range(10):\n    x ="]
INTERVAL = "0.25"  # seconds between one server's refreshes: less than a refresh takes, so the two overlap
WAIT = 120.0  # seconds any one condition may take on 2 busy cores

# every publication of a version, with what it held then (the publishing transaction writes the row, or nobody)
AUDIT = """
CREATE TABLE race_published (
    seq bigserial PRIMARY KEY, version int NOT NULL, tier text NOT NULL, through_id bigint, kept bigint,
    ngram_rows bigint, vocab_rows bigint, has_data boolean, attached bigint
);
CREATE FUNCTION race_note() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO race_published (version, tier, through_id, kept, ngram_rows, vocab_rows, has_data, attached)
    SELECT NEW.id, NEW.tier, (NEW.params ->> 'through_id')::bigint,
        (SELECT coalesce(sum(value::bigint), 0) FROM jsonb_each_text(NEW.figures -> 'kept')),
        (SELECT count(*) FROM crest_ngrams WHERE store_id = NEW.id),
        (SELECT count(*) FROM crest_vocab WHERE store_id = NEW.id),
        EXISTS (SELECT 1 FROM crest_store_data WHERE store_id = NEW.id AND token_table IS NOT NULL),
        (SELECT count(*) FROM pg_inherits WHERE inhrelid IN (
            to_regclass(format('crest_ngrams_s%s', NEW.id)), to_regclass(format('crest_vocab_s%s', NEW.id))));
    RETURN NEW;
END $$;
CREATE TRIGGER race_note AFTER UPDATE OF state ON crest_stores FOR EACH ROW
    WHEN (NEW.state = 'published' AND OLD.state <> 'published') EXECUTE FUNCTION race_note();
"""

# the published versions now, in one repeatable-read snapshot: what each holds against what it says it holds
PUBLISHED = """
SELECT s.id, s.tier, (s.params ->> 'through_id')::bigint,
    (SELECT coalesce(sum(value::bigint), 0) FROM jsonb_each_text(s.figures -> 'kept')),
    (SELECT count(*) FROM crest_ngrams n WHERE n.store_id = s.id),
    (SELECT count(*) FROM crest_vocab v WHERE v.store_id = s.id),
    EXISTS (SELECT 1 FROM crest_store_data d WHERE d.store_id = s.id AND d.token_table IS NOT NULL),
    (SELECT count(*) FROM pg_inherits WHERE inhrelid IN (
        to_regclass(format('crest_ngrams_s%s', s.id)), to_regclass(format('crest_vocab_s%s', s.id))))
FROM crest_stores s WHERE s.name = 'code' AND s.state = 'published' ORDER BY s.id
"""


@pytest.fixture
def race_dsn(db_dsn: str, smollm2_gguf: Path, tmp_path: Path) -> str:
    """A database holding the static store `code` (a small Python corpus), every publication after it noted."""
    corpus = tmp_path / "code.jsonl"
    corpus.write_text(json.dumps({"text": CORPUS}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(AUDIT)
    return db_dsn


def wait_for(what: str, found: Callable[[], T | None], servers: list[ServerProcess], *, timeout: float = WAIT) -> T:
    """Return `found()` once it is not None, polling; fail with the servers' last lines after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = found()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            tails = "; ".join(f"server {i}: {s.tail()}" for i, s in enumerate(servers))
            pytest.fail(f"no {what} within {timeout:.0f} s ({tails})")
        time.sleep(0.1)


def complete(server: ServerProcess, prompt: str) -> str:
    """Return the server's greedy completion of `prompt` (learned, as every request here)."""
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "learn": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def learned(dsn: str, server: ServerProcess, *, after: int, least: int = 1) -> list[tuple[int, dict[str, int]]] | None:
    """Return (id, accepted tokens per draft part) of `server`'s learned rows above id `after`; None below `least`."""
    assert server.proc is not None
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id, accepted_parts FROM crest_learned WHERE store = 'code' AND id > %s AND source LIKE %s"
            " ORDER BY id",
            (after, f"serve@%:{server.proc.pid}"),
        ).fetchall()
    return [(int(i), dict(parts)) for i, parts in rows] if len(rows) >= least else None


def newest_learned(dsn: str) -> int:
    """Return the id of the store's newest learned row (0: none)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM crest_learned WHERE store = 'code'").fetchone()
    return int(row[0]) if row else 0


def live_through(dsn: str) -> int:
    """Return the newest learned row the published live version was built through, after checking it is whole."""
    with psycopg.connect(dsn) as conn:  # one snapshot: READ COMMITTED plans over older partitions than it reads
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        published = conn.execute(PUBLISHED).fetchall()
        static_vocab = static_vocab_rows(conn)
    assert sorted(tier for _, tier, *_ in published) in (["static"], ["live", "static"]), published
    for sid, tier, _, kept, rows, vocab, has_data, attached in published:
        whole = (rows, vocab, has_data, attached) == (kept, static_vocab, True, 2)
        assert whole, f"published version {sid} ({tier}) is not whole: {(rows, vocab, has_data, attached)}, kept {kept}"
    return max((int(through) for _, tier, through, *_ in published if tier == "live"), default=0)


@pytest.mark.slow  # two `crest serve` subprocesses, about a minute
def test_two_servers_race_to_refresh_and_draft_each_others_outputs(
    race_dsn: str, tiny_serve_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each server on one torch thread: two share 2 cores
    args = ["--model", str(tiny_serve_dir), "--dtype", "float64", "--store", "code", "--drafter", "crest"]
    args += ["--dsn", race_dsn, "--max-draft-tokens", "8", "--refresh-interval", INTERVAL, "--refresh-min-tokens", "0"]
    with serve_processes([args, args]) as servers:
        for turn, prompt in enumerate(PROMPTS):  # each server teaches the other, by turns
            teach_and_draft(race_dsn, servers, prompt, teacher=turn % 2, pupil=1 - turn % 2)
        counts = wait_for(
            "quiet: a live version through every learned row, and every publication counted by the servers",
            lambda: quiet(race_dsn, servers),
            servers,
        )
    assert [server.exit_code for server in servers] == [0, 0]  # drained on SIGTERM
    assert all(c["nothing"] > 0 and c["failed"] == 0 for c in counts), counts  # both refreshers ran, none failed
    # they contended: a refresh found the other server's refresh holding the store's lock and skipped
    assert sum(c.get("busy", 0) for c in counts) > 0, counts
    with psycopg.connect(race_dsn, autocommit=True) as conn:
        published = conn.execute(
            "SELECT version, through_id, kept, ngram_rows, vocab_rows, has_data, attached FROM race_published"
            " WHERE tier = 'live' ORDER BY seq"
        ).fetchall()
        ids = {int(i) for (i,) in conn.execute("SELECT id FROM crest_learned WHERE store = 'code'")}
        static_vocab = static_vocab_rows(conn)
        states = conn.execute("SELECT tier, state FROM crest_stores WHERE name = 'code' ORDER BY id").fetchall()
        db.clean_leftovers(conn, name="code")  # what the next refresh does first: drop the retired versions
        tables = conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname ~ '^crest_(ngrams|vocab)_s[0-9]+$'"
        ).fetchall()
        versions = {int(i) for (i,) in conn.execute("SELECT id FROM crest_stores WHERE name = 'code'")}
    throughs = [int(p[1]) for p in published]
    assert throughs == sorted(set(throughs)), f"a round's live version was published more than once: {throughs}"
    assert len(throughs) >= len(PROMPTS) and set(throughs) <= ids, (throughs, sorted(ids))
    assert sum(c["published"] for c in counts) == len(published), (counts, throughs)
    for version, _, kept, rows, vocab, has_data, attached in published:  # whole when published, every one
        assert (rows, vocab, has_data, attached) == (kept, static_vocab, True, 2), f"live version {version}"
    assert {state for _, state in states} <= {"published", "retired"}, states  # no build left behind
    assert sorted(tier for tier, state in states if state == "published") == ["live", "static"], states
    assert {int(name.split("_s")[-1]) for (name,) in tables} == versions and len(versions) == 2, (tables, versions)


def teach_and_draft(dsn: str, servers: list[ServerProcess], prompt: str, *, teacher: int, pupil: int) -> None:
    """One round: the teacher serves and learns `prompt` twice; once a live version holds it, the pupil drafts it."""
    mark = newest_learned(dsn)
    taught = {complete(servers[teacher], prompt) for _ in range(2)}  # twice: a live tier keeps n-grams seen twice
    assert len(taught) == 1, taught  # greedy
    rows = wait_for(
        f"two learned rows of server {teacher}",
        lambda: learned(dsn, servers[teacher], after=mark, least=2),
        servers,
    )
    through = rows[-1][0]
    wait_for(f"live version through learned row {through}", lambda: live_through(dsn) >= through or None, servers)
    seen, deadline = newest_learned(dsn), time.monotonic() + WAIT
    while True:  # the pupil follows the new live version within a second
        assert complete(servers[pupil], prompt) in taught  # greedy: the teacher's text
        rows = wait_for(f"a learned row of server {pupil}", partial(learned, dsn, servers[pupil], after=seen), servers)
        seen, parts = rows[-1]
        if parts.get("live", 0) > 0:
            return  # drafted from the live tier: n-grams seen twice, so in the teacher's rows
        assert time.monotonic() < deadline, f"server {pupil} never drafted {prompt!r} from the live tier: {rows}"


def static_vocab_rows(conn: psycopg.Connection[Any]) -> int:
    """Return the vocabulary rows of the published static version of `code` (a live version copies them all)."""
    row = conn.execute(
        "SELECT count(*) FROM crest_vocab v JOIN crest_stores s ON s.id = v.store_id"
        " WHERE s.name = 'code' AND s.tier = 'static' AND s.state = 'published'"
    ).fetchone()
    return int(row[0]) if row else 0


def quiet(dsn: str, servers: list[ServerProcess]) -> list[dict[str, int]] | None:
    """Return both servers' refresh counts once the live tier holds every learned row and they sum to the trigger's."""
    if live_through(dsn) < newest_learned(dsn):
        return None
    counts = [refresh_counts(server) for server in servers]
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM race_published WHERE tier = 'live'").fetchone()
    return counts if row and sum(c.get("published", 0) for c in counts) == row[0] else None
