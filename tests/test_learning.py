"""The learning tier on a real PostgreSQL: the learned log, live versions built by refresh, forget, and privileges.

A live version must hold exactly the trees an ingest of the same token documents keeps at the same minimum
count (its token table ranks the static version's tokens first); a refresh with nothing new publishes nothing;
a refresh killed while publishing leaves the previous live version; forget removes rows and every live version;
appends from several processes lose nothing; the reader role may append to the log and do nothing else new.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.codec import TokenTable, decode_tree
from psycopg import sql

from crest import db
from crest.config import DEFAULT_LEARN_WINDOW
from crest.db.roles import create_roles
from crest.db.versions import refresh_lock_key
from crest.decoding.tokenizer import load_tokenizer
from crest.errors import ConfigError, StoreNotFound
from crest.ingest.pipeline import ingest
from crest.learning import append_learned, forget, read_window, refresh_live
from crest.learning.live import live_suffix_rule
from tests.fix_corpus import write_jsonl
from tests.fix_learning import OPTIONS, STATIC_TEXT, published, start_paused_refresh, version_rows, wait_until_unlocked

pytest_plugins = ["tests.fix_corpus"]

SERVED = ["the dog sat on the cat", "a cat sat on the dog", "the mat sat on a cat", "the dog sat on the mat"]
SQL_DIR = Path(__file__).resolve().parent.parent / "sql"


@pytest.fixture()
def words(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> str:
    """Publish static store `words` (the word tokenizer) and return the DSN."""
    corpus = write_jsonl(tmp_path / "static.jsonl", [{"text": t} for t in STATIC_TEXT * 2])
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
    return db_dsn


def encode(tokenizer_dir: Path, texts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(tokenizer_dir)
    return [tok.encode(t) for t in texts]


def decoded_rows(dsn: str, store_id: int) -> set[tuple[int, bytes, int, tuple[tuple[int, ...], ...]]]:
    """Return a version's rows with each tree decoded with its own token table: (n, key, count, tree arrays)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT token_table FROM crest_store_data WHERE store_id = %s", (store_id,)).fetchone()
    assert row is not None
    table = TokenTable.from_bytes(row[0])
    out = set()
    for n, key, count, blob in version_rows(dsn, store_id):
        tree = decode_tree(blob, n=n, table=table)
        out.add((n, key, count, tuple(tuple(a.tolist()) for a in (tree.tokens, tree.parents, tree.weights))))
    return out


def table_exists(dsn: str, store_id: int) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regclass(%s)", (f"crest_ngrams_s{store_id}",)).fetchone()
    return row is not None and row[0] is not None


def learned_count(dsn: str, store: str = "words") -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM crest_learned WHERE store = %s", (store,)).fetchone()
    assert row is not None
    return int(row[0])


def test_migration_keeps_existing_versions_static(empty_db: str) -> None:
    db.upgrade(empty_db, revision="0002")
    with psycopg.connect(empty_db) as conn:
        conn.execute(
            "INSERT INTO crest_stores (name, state, tokenizer_fingerprint, vocab_size, token_width)"
            " VALUES ('old', 'published', 'f', 9, 1)"
        )
    assert db.upgrade(empty_db, revision="0003") == "0003"
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT tier FROM crest_stores WHERE name = 'old'").fetchone() == ("static",)
        conn.execute(
            "INSERT INTO crest_stores (name, tier, state, tokenizer_fingerprint, vocab_size, token_width)"
            " VALUES ('old', 'live', 'published', 'f', 9, 1)"
        )  # one published version per tier
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(
                "INSERT INTO crest_stores (name, tier, state, tokenizer_fingerprint, vocab_size, token_width)"
                " VALUES ('old', 'live', 'published', 'f', 9, 1)"
            )


WINDOWS = [(100, [[5, 6, 7], [8], [9, 10]], 1), (5, [[6, 7], [8], [9, 10]], 1), (2, [[9, 10]], 3)]


@pytest.mark.parametrize(("window", "docs", "from_row"), WINDOWS, ids=["all", "cut-row", "newest-only"])
def test_read_window_returns_the_last_tokens_one_document_per_row(
    db_dsn: str, window: int, docs: list[list[int]], from_row: int
) -> None:
    assert append_learned(db_dsn, "s", [[5, 6, 7], [], [8], [9, 10]], prompt_tokens=[1, 0, 0, 2]) == 3
    append_learned(db_dsn, "other", [[1, 2, 3]])
    with psycopg.connect(db_dsn) as conn:
        ids = [int(r[0]) for r in conn.execute("SELECT id FROM crest_learned WHERE store = 's' ORDER BY id")]
        prompts = [int(r[0]) for r in conn.execute("SELECT prompt_tokens FROM crest_learned WHERE store = 's'")]
        win = read_window(conn, "s", window=window, max_n=3)  # prompts of at most max_n: rows whole
    assert sorted(prompts) == [0, 1, 2]
    assert [win.tokens[a:b].tolist() for a, b in zip(win.offsets[:-1], win.offsets[1:], strict=True)] == docs
    assert (win.from_id, win.through_id, win.rows) == (ids[from_row - 1], ids[-1], len(docs))


def test_read_window_leaves_out_rows_outside_the_vocabulary(db_dsn: str) -> None:
    append_learned(db_dsn, "s", [[1, 2], [3, 99], [4]])
    with psycopg.connect(db_dsn) as conn:
        win = read_window(conn, "s", window=10, max_n=3, vocab_size=10)
    assert win.tokens.tolist() == [1, 2, 4] and win.rows == 2


BAD_APPENDS = [
    ("negative-id", [[1, -1]], 0),
    ("prompt-longer-than-row", [[1, 2]], 3),
    ("prompt-count-mismatch", [[1], [2]], [0]),
    ("not-flat", [[[1, 2]]], 0),
]


@pytest.mark.parametrize(("lists", "prompt"), [b[1:] for b in BAD_APPENDS], ids=[b[0] for b in BAD_APPENDS])
def test_append_learned_rejects_bad_input_and_writes_nothing(db_dsn: str, lists: Any, prompt: Any) -> None:
    with pytest.raises(ConfigError):
        append_learned(db_dsn, "s", [[7, 8], *lists], prompt_tokens=prompt if isinstance(prompt, int) else [0, *prompt])
    assert learned_count(db_dsn, "s") == 0


def test_append_learned_writes_figures_and_any_part_and_refuses_bad_ones(db_dsn: str) -> None:
    figures = [{"steps": 3, "accepted_tokens": 4, "accepted_live": 4, "accepted_dense": 2, "accepted_prompt": 0}, None]
    assert append_learned(db_dsn, "s", [[1, 2], [3]], stats=figures) == 2
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute("SELECT steps, accepted_tokens, accepted_parts FROM crest_learned ORDER BY id").fetchall()
    assert rows == [(3, 4, {"live": 4, "dense": 2}), (0, 0, {})]  # a part no migration knows; zeros left out
    bads: list[dict[str, Any]] = [{"accepted_Live": 1}, {"live": 1}, {"accepted_live": -1}, {"accepted_live": "x"}]
    for bad in bads:
        with pytest.raises(ConfigError, match="learned figures"):
            append_learned(db_dsn, "t", [[7], [8]], stats=[{"steps": 1}, bad])
    assert learned_count(db_dsn, "t") == 0


def test_refresh_publishes_a_live_version_equal_to_an_ingest_of_the_same_documents(
    words: str, word_tokenizer_dir: Path, tmp_path: Path
) -> None:
    dsn = words
    served = encode(word_tokenizer_dir, SERVED)
    append_learned(dsn, "words", served, source="test")
    done = refresh_live(dsn, "words")
    assert done is not None and done.rows == len(SERVED) and done.tokens == sum(map(len, served))

    corpus = write_jsonl(tmp_path / "served.jsonl", [{"text": t} for t in SERVED])
    options = dataclasses.replace(OPTIONS, suffix_rule=live_suffix_rule(OPTIONS.suffix_rule))  # never pruned
    reference = ingest([str(corpus)], store="reference", tokenizer=str(word_tokenizer_dir), dsn=dsn, options=options)
    expected = {row for row in decoded_rows(dsn, reference.store_id) if row[2] >= 2}  # the live tier's min count
    assert expected and done.ngrams == len(expected)
    assert decoded_rows(dsn, done.store_id) == expected  # the same trees, ranked by another token table
    assert len(version_rows(dsn, reference.store_id)) > len(expected), "the corpus has n-grams seen once"

    static_id = published(dsn, "words")["static"]
    assert published(dsn, "words") == {"static": static_id, "live": done.store_id}
    with psycopg.connect(dsn) as conn:
        live, static, ref = (
            conn.execute(
                "SELECT s.tokenizer_fingerprint, s.vocab_size, s.token_width, s.params, d.token_table,"
                " (SELECT count(*) FROM crest_vocab v WHERE v.store_id = s.id)"
                " FROM crest_stores s JOIN crest_store_data d ON d.store_id = s.id WHERE s.id = %s",
                (sid,),
            ).fetchone()
            or ()
            for sid in (done.store_id, static_id, reference.store_id)
        )
    assert live[:3] == static[:3] and live[5] == static[5] > 0  # the static version's tokenizer and vocabulary
    # the token table does not follow the window: the static version's ranking, then every other id
    static_ranks = TokenTable.from_bytes(static[4]).tokens
    live_ranks = TokenTable.from_bytes(live[4]).tokens
    assert live[4] != ref[4] and len(live_ranks) == live[1]
    assert live_ranks[: len(static_ranks)].tolist() == static_ranks.tolist()
    assert sorted(live_ranks[len(static_ranks) :].tolist()) == live_ranks[len(static_ranks) :].tolist()
    params = live[3]
    assert (
        params["tier"] == "live" and params["window"] == DEFAULT_LEARN_WINDOW and params["static_version"] == static_id
    )
    assert (params["from_id"], params["through_id"]) == (done.from_id, done.through_id)
    assert params["max_n"] == 3 and params["continuation_length"] == 4  # the static store's build options
    assert params["build"] == {"mode": "full", "reused": 0, "built": done.ngrams, "why": "no live version"}


def test_refresh_with_nothing_new_publishes_nothing_and_a_new_one_drops_the_old(
    words: str, word_tokenizer_dir: Path
) -> None:
    dsn = words
    assert refresh_live(dsn, "words") is None  # nothing learned yet
    served = encode(word_tokenizer_dir, SERVED)
    append_learned(dsn, "words", served[:2])
    first = refresh_live(dsn, "words")
    assert first is not None and first.replaced is None
    assert refresh_live(dsn, "words") is None
    append_learned(dsn, "words", served[2:])
    new_tokens = sum(map(len, served[2:]))
    assert refresh_live(dsn, "words", min_new_tokens=new_tokens + 1) is None
    second = refresh_live(dsn, "words", min_new_tokens=new_tokens, window=12)
    assert second is not None and second.replaced == first.store_id and second.new_rows == 2
    assert second.tokens == 12 and second.through_id > first.through_id
    assert published(dsn, "words")["live"] == second.store_id
    assert not table_exists(dsn, first.store_id) and table_exists(dsn, second.store_id)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM crest_stores WHERE tier = 'live'").fetchone() == (1,)


def test_refresh_skips_while_another_refresh_holds_the_store(words: str, word_tokenizer_dir: Path) -> None:
    append_learned(words, "words", encode(word_tokenizer_dir, SERVED))
    with psycopg.connect(words, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", refresh_lock_key("words"))
        assert refresh_live(words, "words") is None
        # released here, in this statement: a closed session's locks go when its backend exits, a moment later
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", refresh_lock_key("words"))
    assert refresh_live(words, "words") is not None


def test_refresh_needs_a_published_static_store(db_dsn: str) -> None:
    append_learned(db_dsn, "nothing", [[1, 2, 3]])
    with pytest.raises(StoreNotFound, match="no published store named 'nothing'"):
        refresh_live(db_dsn, "nothing")


@pytest.mark.parametrize("stage", ["load", "publish"], ids=["load", "publish"])
def test_killed_refresh_leaves_the_previous_live_version_and_the_next_cleans_up(
    words: str, word_tokenizer_dir: Path, tmp_path: Path, stage: str
) -> None:
    dsn = words
    served = encode(word_tokenizer_dir, SERVED)
    append_learned(dsn, "words", served[:2])
    first = refresh_live(dsn, "words")
    assert first is not None
    before, rows = published(dsn, "words"), version_rows(dsn, first.store_id)
    append_learned(dsn, "words", served[2:])

    proc = start_paused_refresh(dsn, tmp_path / "home", stage)
    assert published(dsn, "words") == before
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_unlocked(dsn)
    assert published(dsn, "words") == before and version_rows(dsn, first.store_id) == rows
    with psycopg.connect(dsn) as conn:
        states: dict[int, str] = dict(conn.execute("SELECT id, state FROM crest_stores WHERE tier = 'live'").fetchall())
    killed = max(states)
    assert states == {first.store_id: "published", killed: "building"} and table_exists(dsn, killed)

    again = refresh_live(dsn, "words")
    assert again is not None and again.replaced == first.store_id and again.rows == len(SERVED)
    with psycopg.connect(dsn) as conn:
        live = conn.execute("SELECT id, state FROM crest_stores WHERE tier = 'live'").fetchall()
    assert live == [(again.store_id, "published")]
    assert not table_exists(dsn, killed) and not table_exists(dsn, first.store_id)


def test_forget_removes_rows_and_live_versions_and_keeps_the_static_one(words: str, word_tokenizer_dir: Path) -> None:
    dsn = words
    append_learned(dsn, "words", encode(word_tokenizer_dir, SERVED))
    append_learned(dsn, "other", [[1, 2]])
    live = refresh_live(dsn, "words")
    assert live is not None
    static = published(dsn, "words")["static"]

    done = forget(dsn, "words")
    assert (done.rows, done.versions) == (len(SERVED), [live.store_id])
    assert published(dsn, "words") == {"static": static}
    assert learned_count(dsn) == 0 and learned_count(dsn, "other") == 1
    assert not table_exists(dsn, live.store_id)
    assert refresh_live(dsn, "words") is None  # nothing left to learn from
    assert forget(dsn, "words").rows == 0
    with pytest.raises(StoreNotFound):
        forget(dsn, "never_seen")


def test_forget_before_keeps_newer_rows_and_the_next_refresh_rebuilds_from_them(
    words: str, word_tokenizer_dir: Path
) -> None:
    dsn = words
    served = encode(word_tokenizer_dir, SERVED)
    append_learned(dsn, "words", served[:2])
    cutoff = datetime.now(timezone.utc)
    with psycopg.connect(dsn) as conn:  # the first rows were learned a day ago
        conn.execute("UPDATE crest_learned SET created_at = %s", (cutoff - timedelta(days=1),))
    append_learned(dsn, "words", served[2:])
    live = refresh_live(dsn, "words")
    assert live is not None and live.rows == 4

    done = forget(dsn, "words", before=cutoff)
    assert (done.rows, done.versions) == (2, [live.store_id])
    assert learned_count(dsn) == 2 and "live" not in published(dsn, "words")
    rebuilt = refresh_live(dsn, "words")
    assert rebuilt is not None and rebuilt.rows == 2 and rebuilt.tokens == sum(map(len, served[2:]))
    assert rebuilt.from_id > live.from_id


def _append_many(dsn: str, worker: int, rows: int) -> None:
    for i in range(rows):  # one transaction per row: the most interleaving
        append_learned(dsn, "words", [[worker, i, worker * 1000 + i]], source=f"worker-{worker}")


def test_concurrent_appends_from_several_processes_lose_nothing(db_dsn: str) -> None:
    workers, rows = 4, 200
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(db_dsn, w, rows)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    with psycopg.connect(db_dsn) as conn:
        got = [(str(s), bytes(t)) for s, t in conn.execute("SELECT source, tokens FROM crest_learned")]
    expected = {
        (f"worker-{w}", np.array([w, i, w * 1000 + i], "<u4").tobytes()) for w in range(workers) for i in range(rows)
    }
    assert len(got) == workers * rows and set(got) == expected


@pytest.fixture()
def reader_dsn(db_dsn: str) -> Iterator[str]:
    """Yield the DSN of a reader role made by `create_roles` (removed afterwards)."""
    tag, password = uuid.uuid4().hex[:8], uuid.uuid4().hex
    reader, writer = f"crest_r_{tag}", f"crest_w_{tag}"
    create_roles(db_dsn, reader=reader, writer=writer, reader_password=password, writer_password=password)
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    info.update(user=reader, password=password)
    yield psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for role in (reader, writer):
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_reader_role_may_append_learned_rows_and_nothing_else(
    words: str, reader_dsn: str, word_tokenizer_dir: Path
) -> None:
    assert append_learned(reader_dsn, "words", [[2, 3, 4], [5, 6]], source="server-1") == 2
    with psycopg.connect(reader_dsn) as conn:
        conn.execute("INSERT INTO crest_learned (store, tokens, n_tokens) VALUES ('words', '\\x02000000', 1)")
    assert learned_count(words) == 3
    static = published(words, "words")["static"]
    for statement in (
        "UPDATE crest_learned SET store = 'x'",
        "DELETE FROM crest_learned",
        "TRUNCATE crest_learned",
        "INSERT INTO crest_learned (id, store, tokens, n_tokens) OVERRIDING SYSTEM VALUE VALUES (1, 'x', '', 0)",
        "INSERT INTO crest_learned (store, tokens, n_tokens, created_at) VALUES ('x', '', 0, now() - interval '1 day')",
        "INSERT INTO crest_stores (name, state, tokenizer_fingerprint, vocab_size, token_width)"
        " VALUES ('x', 'building', 'f', 1, 1)",
        f"INSERT INTO crest_ngrams_s{static} (store_id, count, n, key, tree) VALUES ({static}, 1, 1, '', '')",
        "UPDATE crest_stores SET state = 'retired'",
    ):
        with psycopg.connect(reader_dsn, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)
    with pytest.raises(Exception, match="permission denied"):
        refresh_live(reader_dsn, "words")
    assert learned_count(words) == 3 and published(words, "words") == {"static": static}


def test_drop_store_drops_both_tiers_and_what_it_learned(words: str, word_tokenizer_dir: Path) -> None:
    append_learned(words, "words", encode(word_tokenizer_dir, SERVED))
    append_learned(words, "other", [[1]])
    live = refresh_live(words, "words")
    assert live is not None
    static = published(words, "words")["static"]
    with psycopg.connect(words) as conn:
        assert db.drop_store(conn, "words") == static
    assert published(words, "words") == {} and learned_count(words) == 0 and learned_count(words, "other") == 1
    assert not table_exists(words, static) and not table_exists(words, live.store_id)


def test_stores_and_queries_count_learned_bytes(words: str, word_tokenizer_dir: Path) -> None:
    served = encode(word_tokenizer_dir, SERVED)
    append_learned(words, "words", served, prompt_tokens=1)
    live = refresh_live(words, "words")
    assert live is not None
    append_learned(words, "words", served[:1])  # not in the live version yet
    with psycopg.connect(words) as conn:
        listed = {r["tier"]: r for r in db.list_stores(conn)}
        total = conn.execute("SELECT pg_total_relation_size('crest_learned')").fetchone()
        learned = conn.execute((SQL_DIR / "learned.sql").read_text())
        (row,) = [dict(zip([c.name for c in learned.description or []], r, strict=True)) for r in learned]
        disk = conn.execute((SQL_DIR / "disk_use.sql").read_text())
        disk_rows = [dict(zip([c.name for c in disk.description or []], r, strict=True)) for r in disk]
    assert total is not None
    table_bytes = int(total[0])
    assert set(listed) == {"static", "live"} and listed["live"]["id"] == live.store_id
    assert listed["live"]["learned_rows"] == len(SERVED) + 1
    assert listed["static"]["learned_bytes"] == table_bytes > 0  # the only store that learned
    assert row["store"] == "words" and row["rows"] == len(SERVED) + 1 and row["bytes"] == table_bytes
    assert row["tokens"] == sum(map(len, served)) + len(served[0]) and row["prompt_tokens"] == len(SERVED)
    assert row["live_version"] == live.store_id and row["through_id"] == live.through_id
    assert row["rows_not_live"] == 1 and row["window_tokens"] == DEFAULT_LEARN_WINDOW
    assert {(r["tier"], r["learned_bytes"]) for r in disk_rows} == {
        ("static", table_bytes),
        ("live", table_bytes),
    }
