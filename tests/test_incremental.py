"""Incremental refresh on a real PostgreSQL: it equals a full rebuild of the same window, byte for byte.

Two stores with the same static version learn the same random streams (rows appended, the window sliding, its
oldest row cut, n-grams with more occurrences than `max_matches`); one is refreshed incrementally, the other
rebuilt in full, and after every refresh their live versions must hold the same rows (key, count, blob), token
table, key filter and figures. A refresh falls back to a full rebuild when it cannot reuse the previous live
version, and one killed after copying rows leaves the previous live version published. Of a learned row only the
prompt's last max-n tokens and the output are counted: rows with a server's longer prompt tail build the same live
versions as rows with a max-n tail.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from crest.learning import append_learned, refresh_live
from crest.learning.incremental import read_learned
from crest.learning.journal import read_window
from crest.learning.requests import PROMPT_TAIL, served_tokens
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_learning import published, start_paused_refresh, version_rows, wait_until_unlocked

pytest_plugins = ["tests.fix_corpus"]

VOCAB = [f"w{i}" for i in range(300)]
OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=4, max_matches=6, tree_size=8)
STORES = ("inc", "ref")  # refreshed incrementally / rebuilt in full


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word tokenizer of 300 words (ids 2..301)."""
    return make_word_tokenizer(tmp_path_factory.mktemp("incremental-tokenizer"), VOCAB)


def make_static(
    dsn: str, tokenizer_dir: Path, tmp_path: Path, stores: tuple[str, ...] = STORES, options: IngestOptions = OPTIONS
) -> None:
    """Publish the same static version of each store (the words of the first 40 ids, twice)."""
    corpus = write_jsonl(tmp_path / "static.jsonl", [{"text": " ".join(VOCAB[:40])}] * 2)
    for store in stores:
        ingest([str(corpus)], store=store, tokenizer=str(tokenizer_dir), dsn=dsn, options=options)


def random_rows(rng: np.random.Generator, count: int, longest: int) -> list[list[int]]:
    """Return `count` rows of Zipf-like token ids with repeated phrases (a few ids exceed max_matches)."""
    phrases = [rng.integers(2, 302, size=rng.integers(2, 6)).tolist() for _ in range(12)]
    rows = []
    for _ in range(count):
        row: list[int] = []
        length = int(rng.integers(1, longest + 1))
        while len(row) < length:
            if rng.random() < 0.3:
                row += phrases[int(rng.integers(len(phrases)))]
            else:
                row.append(2 + min(299, int(rng.zipf(1.3)) - 1))
        rows.append(row[:length])
    return rows


def live_version(dsn: str, store: str) -> tuple[Any, ...]:
    """Return a store's live version: rows, token table, key filter, figures and build record."""
    sid = published(dsn, store)["live"]
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT d.token_table, d.key_filter, s.figures, s.params FROM crest_store_data d"
            " JOIN crest_stores s ON s.id = d.store_id WHERE s.id = %s",
            (sid,),
        ).fetchone()
    assert row is not None
    table, key_filter, figures, params = row
    keep = ("kept", "covered", "counted", "positions", "avg_tree_nodes", "blob_bytes", "tokens", "documents")
    return version_rows(dsn, sid), bytes(table), bytes(key_filter), {k: figures[k] for k in keep}, params["build"]


def assert_unpruned(dsn: str, store: str) -> None:
    """Check the live version of a pruned static store was built unpruned (`lookup`): a live tier drafts by its
    longest suffix, so pruning by the `expected` rule would drop the rows it drafts from."""
    sid = published(dsn, store)["live"]
    with psycopg.connect(dsn) as conn:
        params = conn.execute("SELECT params FROM crest_stores WHERE id = %s", (sid,)).fetchone()
    assert params is not None and params[0]["suffix_rule"] == "lookup"


def over_max_matches(dsn: str, store: str) -> int:
    """Return how many rows of the store's live version hold an n-gram seen more than max_matches times."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM crest_ngrams WHERE store_id = %s AND count > %s",
            (published(dsn, store)["live"], OPTIONS.max_matches),
        ).fetchone()
    return int(row[0]) if row else 0


STREAMS = [
    # (seed, window, rows per append, longest row, appends)
    (1, 400, (1, 4), 40, 10),  # the window slides, its oldest row cut
    (2, 10_000, (1, 3), 30, 8),  # append only: nothing leaves
    (3, 300, (1, 2), 120, 10),  # rows longer than what is appended: the cut row changes every time
    (4, 600, (2, 6), 25, 10),
]


@pytest.mark.parametrize(
    ("seed", "window", "per_append", "longest", "appends", "suffix_rule"),
    [(*stream, "lookup") for stream in STREAMS]
    + [(*STREAMS[0], "backoff"), (*STREAMS[2], "backoff"), (*STREAMS[0], "prune"), (*STREAMS[2], "prune")],
    ids=[
        "sliding",
        "append-only",
        "long-cut-rows",
        "many-short-rows",
        "sliding-backoff",
        "long-cut-rows-backoff",
        "sliding-prune",
        "long-cut-rows-prune",
    ],
)
def test_incremental_refresh_equals_a_full_rebuild(
    db_dsn: str,
    tokenizer_dir: Path,
    tmp_path: Path,
    seed: int,
    window: int,
    per_append: tuple[int, int],
    longest: int,
    appends: int,
    suffix_rule: str,
) -> None:
    make_static(db_dsn, tokenizer_dir, tmp_path, options=replace(OPTIONS, suffix_rule=suffix_rule))
    rng = np.random.default_rng(seed)
    append_learned(db_dsn, "other", [[5, 6]])  # another store's rows interleave the ids
    modes, reused, built, sampled = [], 0, 0, 0
    for step in range(appends):
        rows = random_rows(rng, int(rng.integers(*per_append, endpoint=True)) + (8 if step == 0 else 0), longest)
        for store in STORES:
            append_learned(db_dsn, store, rows)
            append_learned(db_dsn, "other", [[7]])
        inc = refresh_live(db_dsn, "inc", window=window, max_ngrams=200)
        ref = refresh_live(db_dsn, "ref", window=window, max_ngrams=200, incremental=False)
        assert inc is not None and ref is not None
        got, want = live_version(db_dsn, "inc"), live_version(db_dsn, "ref")
        assert got[:4] == want[:4], f"step {step}: the incremental refresh differs from a full rebuild"
        assert want[4]["mode"] == "full" and want[4]["why"] == "asked"
        assert (inc.mode, inc.reused, inc.built) == (got[4]["mode"], got[4]["reused"], got[4]["built"])
        assert inc.reused + inc.built == inc.ngrams == ref.ngrams > 0
        if suffix_rule == "prune":
            assert_unpruned(db_dsn, "inc")
        modes.append(inc.mode)
        reused, built = reused + inc.reused, built + inc.built
        sampled = max(sampled, over_max_matches(db_dsn, "inc"))
    assert modes[0] == "full" and modes.count("incremental") >= appends // 2, modes
    assert reused > 0 and built > 0, "the streams must exercise both copied and built rows"
    assert sampled > 0, "the streams must hold n-grams sampled down to max_matches occurrences"


def test_read_learned_reads_the_window_read_window_reads(db_dsn: str) -> None:
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 50, size=int(rng.integers(1, 30))).tolist() for _ in range(40)]
    rows[7] = [60, 1]  # an id outside the vocabulary: left out of both
    rows[9] = [61, *rows[9]]  # one outside it in a prompt's uncounted part: the row is read
    prompts = [int(rng.integers(0, len(r) + 1)) for r in rows]
    prompts[9] = len(rows[9])
    append_learned(db_dsn, "s", rows, prompt_tokens=prompts)
    counted = {i: r[max(0, k - OPTIONS.max_n) :] for i, (r, k) in enumerate(zip(rows, prompts, strict=True))}
    with psycopg.connect(db_dsn) as conn:
        newest = int(conn.execute("SELECT max(id) FROM crest_learned").fetchone()[0])  # type: ignore[index]
        whole = read_window(conn, "s", window=10**6, max_n=OPTIONS.max_n, vocab_size=55)
        for window in (1, 17, 200, 10_000):
            want = read_window(conn, "s", window=window, max_n=OPTIONS.max_n, through_id=newest - 3, vocab_size=55)
            got = read_learned(conn, "s", window=window, max_n=OPTIONS.max_n, through_id=newest - 3, vocab_size=55,
                               down_to=newest - 30)  # fmt: skip
            assert got.window.tokens.tolist() == want.tokens.tolist()
            assert got.window.offsets.tolist() == want.offsets.tolist()
            assert (got.window.from_id, got.window.through_id, got.window.rows) == (
                want.from_id,
                want.through_id,
                want.rows,
            )
            assert len(got.ids) == want.rows and got.ids.tolist() == sorted(got.ids.tolist())
            assert all(newest - 30 <= sid < want.from_id for sid, _ in got.below)
    docs = [whole.tokens[a:b].tolist() for a, b in zip(whole.offsets[:-1], whole.offsets[1:], strict=True)]
    assert docs == [counted[i] for i in range(len(rows)) if i != 7]  # each row from its prompt's last max-n on


def test_a_longer_prompt_tail_leaves_the_live_tier_unchanged(db_dsn: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Requests learned with a server's prompt tail (`PROMPT_TAIL`) build, refresh after refresh, the live versions
    the same requests learned with a max-n tail build: a long system prompt in every request is never counted."""
    stores = {"long": PROMPT_TAIL, "short": OPTIONS.max_n}  # store -> prompt tokens its rows keep
    make_static(db_dsn, tokenizer_dir, tmp_path, stores=tuple(stores))
    rng = np.random.default_rng(9)
    system = rng.integers(2, 302, size=PROMPT_TAIL + 20).tolist()  # the same prompt head in every request
    modes = []
    for step in range(6):
        asked = [system + row for row in random_rows(rng, 4, 12)]
        answers = random_rows(rng, 4, 40)
        for store, tail in stores.items():
            served = [served_tokens(p, a, tail=tail) for p, a in zip(asked, answers, strict=True)]
            append_learned(db_dsn, store, [ids for ids, _ in served], prompt_tokens=[k for _, k in served])
        new = sum(OPTIONS.max_n + len(a) for a in answers)  # counted tokens: the prompts' last max-n, the answers
        if step == 5:  # a refresh waits for as many new tokens in both
            assert [refresh_live(db_dsn, s, window=300, min_new_tokens=new + 1) for s in stores] == [None, None]
        long, short = (refresh_live(db_dsn, s, window=300, min_new_tokens=new) for s in stores)
        assert long is not None and short is not None, step
        figures = [(r.tokens, r.ngrams, r.mode, r.reused) for r in (long, short)]
        assert figures[0] == figures[1], step
        assert live_version(db_dsn, "long")[:4] == live_version(db_dsn, "short")[:4], step  # rows, tables, figures
        modes.append(long.mode)
    assert "incremental" in modes and figures[0][0] == 300  # rows were copied, the window slid


def late_row(dsn: str, store: str, tokens: list[int]) -> None:
    """Write a row of `store` under a free id inside its live version's window, as a late commit would."""
    with psycopg.connect(dsn) as conn:
        params = conn.execute(
            "SELECT params FROM crest_stores WHERE name = %s AND tier = 'live' AND state = 'published'", (store,)
        ).fetchone()[0]  # type: ignore[index]
        free = conn.execute(
            "DELETE FROM crest_learned WHERE id = (SELECT min(id) FROM crest_learned WHERE store = 'other'"
            " AND id > %s AND id < %s) RETURNING id",
            (params["from_id"], params["through_id"]),
        ).fetchone()
        assert free is not None
        conn.execute(
            "INSERT INTO crest_learned (id, store, tokens, n_tokens) OVERRIDING SYSTEM VALUE VALUES (%s, %s, %s, %s)",
            (free[0], store, np.array(tokens, dtype="<u4").tobytes(), len(tokens)),
        )


FALLBACKS = ["no-live-version", "static-changed", "options-changed", "most-changed", "late-commit", "asked"]


@pytest.mark.parametrize("case", FALLBACKS, ids=FALLBACKS)
def test_refresh_falls_back_to_a_full_rebuild(db_dsn: str, tokenizer_dir: Path, tmp_path: Path, case: str) -> None:
    make_static(db_dsn, tokenizer_dir, tmp_path)
    rng = np.random.default_rng(11)
    for store in STORES:
        for row in random_rows(rng, 12, 30):
            append_learned(db_dsn, store, [row])
            append_learned(db_dsn, "other", [[9]])
    kwargs: dict[str, Any] = {"window": 5000, "max_ngrams": 200}
    if case != "no-live-version":
        assert refresh_live(db_dsn, "inc", **kwargs) is not None
    small, large = random_rows(rng, 1, 10), random_rows(rng, 30, 30)
    if case == "static-changed":
        make_static(db_dsn, tokenizer_dir, tmp_path, stores=("inc",))
    if case == "options-changed":
        kwargs["max_ngrams"] = 150
    if case == "late-commit":
        late_row(db_dsn, "inc", small[0])
    append_learned(db_dsn, "inc", large if case == "most-changed" else small)
    done = refresh_live(db_dsn, "inc", incremental=case != "asked", **kwargs)
    assert done is not None and done.mode == "full" and done.reused == 0
    why = {
        "no-live-version": "no live version",
        "static-changed": "static version changed",
        "options-changed": "build options changed",
        "most-changed": "most of the window changed",
        "late-commit": "rows committed late inside the previous window",
        "asked": "asked",
    }[case]
    assert live_version(db_dsn, "inc")[4] == {"mode": "full", "reused": 0, "built": done.ngrams, "why": why}
    append_learned(db_dsn, "inc", random_rows(rng, 1, 10))
    again = refresh_live(db_dsn, "inc", **kwargs)  # the same setting again: incremental
    assert again is not None and again.mode == "incremental" and again.reused > 0


def test_killed_incremental_refresh_leaves_the_previous_live_version(
    db_dsn: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    make_static(db_dsn, tokenizer_dir, tmp_path, stores=("words",))
    rng = np.random.default_rng(3)
    append_learned(db_dsn, "words", random_rows(rng, 20, 30))
    first = refresh_live(db_dsn, "words")
    assert first is not None
    before, rows = published(db_dsn, "words"), version_rows(db_dsn, first.store_id)
    append_learned(db_dsn, "words", random_rows(rng, 1, 30))

    proc = start_paused_refresh(db_dsn, tmp_path / "home", "reuse")  # rows copied, not published
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_unlocked(db_dsn)
    assert published(db_dsn, "words") == before and version_rows(db_dsn, first.store_id) == rows

    again = refresh_live(db_dsn, "words")
    assert again is not None and again.mode == "incremental" and again.replaced == first.store_id
    with psycopg.connect(db_dsn) as conn:
        live = conn.execute("SELECT id, state FROM crest_stores WHERE tier = 'live'").fetchall()
    assert live == [(again.store_id, "published")]


def test_refresh_copies_exactly_the_rows_no_changed_row_touches(
    db_dsn: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    make_static(db_dsn, tokenizer_dir, tmp_path, stores=("inc",))
    # the oldest row is always rebuilt (it may be cut), so a filler goes first; 256 ends keys in a zero byte
    append_learned(db_dsn, "inc", [[40], *[[256, 256, 7, 256, 9]] * 3, *[[20, 21, 22]] * 2])
    first = refresh_live(db_dsn, "inc")
    assert first is not None and first.mode == "full"
    append_learned(db_dsn, "inc", [[20, 21, 22]])
    done = refresh_live(db_dsn, "inc")
    # built: 20, 21 and (20, 21) (in the new row; 22 ends every row, so its n-grams have no tree) and 256
    # (9 occurrences, more than max_matches); copied: every other row, those whose key ends in 256 included
    assert done is not None and (done.mode, done.built, done.reused) == ("incremental", 4, 6) and first.ngrams == 10
