"""Keeping n-grams by expected saved tokens (`--keep savings|marginal`): scores, budget, params, CLI errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psycopg
import pytest
from crest_client.codec import encode_tree

from crest.config import IngestOptions
from crest.errors import EXIT_USAGE, ConfigError
from crest.ingest.disk import estimate_row_bytes, fixed_bytes, store_bytes
from crest.ingest.pipeline import Vocabulary, build_store
from crest.ingest.selection import choose, expected_accepted, score

VOCAB = 64
COMMON, STEADY, NEXT, LAST = 1, 2, 5, 6


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """Return documents where the most common token never repeats a continuation and a rarer one always does."""
    docs = [[COMMON, 10 + 2 * i, 11 + 2 * i] for i in range(12)]  # 12 x COMMON, every continuation unique
    docs += [[STEADY, NEXT, LAST]] * 4  # 4 x STEADY -> NEXT LAST, every time
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    offsets = np.r_[0, np.cumsum([len(d) for d in docs])].astype(np.int64)
    return tokens, offsets


def vocabulary() -> Vocabulary:
    return Vocabulary("hand-made", "fp-hand-made", VOCAB, lambda: [(i, f"t{i}") for i in range(VOCAB)])


def build(dsn: str, store: str, **options: object) -> None:
    tokens, offsets = corpus()
    opts = IngestOptions(max_n=1, continuation_length=2, **options)  # type: ignore[arg-type]
    build_store(tokens, offsets, store=store, dsn=dsn, vocabulary=vocabulary(), options=opts)


def stored(dsn: str, store: str) -> list[tuple[bytes, bytes]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT g.key, g.tree FROM crest_ngrams g JOIN crest_stores s ON s.id = g.store_id"
            " WHERE s.name = %s AND s.state = 'published' ORDER BY g.key",
            (store,),
        ).fetchall()
    return [(bytes(k), bytes(t)) for k, t in rows]


def first_tokens(rows: list[tuple[bytes, bytes]]) -> set[int]:
    return {int.from_bytes(key, "big") for key, _ in rows}


@pytest.mark.parametrize(
    ("keep", "expected"),
    [("count", {COMMON}), ("savings", {STEADY}), ("marginal", {STEADY})],
    ids=["count-keeps-most-common", "savings-keeps-steady", "marginal-keeps-steady"],
)
def test_keep_rule_picks(db_dsn: str, keep: str, expected: set[int]) -> None:
    build(db_dsn, "hand", top_t=1, keep=keep)
    assert first_tokens(stored(db_dsn, "hand")) == expected


def test_savings_ranks_by_score(db_dsn: str) -> None:
    # pool (3 x top-t by count): COMMON 12, STEADY 4, NEXT 4; scores 0, 4 x 2, 4 x 1
    build(db_dsn, "hand", top_t=2, keep="savings")
    assert first_tokens(stored(db_dsn, "hand")) == {STEADY, NEXT}


@pytest.mark.parametrize("rows", [1, 2, 3], ids=["one-row", "two-rows", "three-rows"])
def test_budget_respected(db_dsn: str, rows: int) -> None:
    build(db_dsn, "big", top_t=10, keep="savings")
    every = stored(db_dsn, "big")
    sizes = sorted(int(estimate_row_bytes(1, len(tree))) for _, tree in every)
    fixed = fixed_bytes(4 * len(set(corpus()[0].tolist())))  # the token table: 4 bytes a token seen
    budget = int(store_bytes(sum(sizes[-rows:]), rows, fixed=fixed))  # room for `rows` rows of any size, not all
    build(db_dsn, "fit", budget=budget, keep="savings")
    kept = stored(db_dsn, "fit")
    assert 0 < len(kept) < len(every)
    assert store_bytes(sum(int(estimate_row_bytes(1, len(tree))) for _, tree in kept), len(kept), fixed=fixed) <= budget
    assert STEADY in first_tokens(kept)  # the best score comes first


@pytest.mark.parametrize("keep", ["count", "savings"], ids=["count", "savings"])
def test_params_recorded(db_dsn: str, keep: str) -> None:
    build(db_dsn, "hand", top_t=1, keep=keep)
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT params FROM crest_stores WHERE name = 'hand' AND state = 'published'").fetchone()
    assert row is not None and row[0]["keep"] == keep


def test_bad_keep_refused() -> None:
    with pytest.raises(ConfigError, match="--keep"):
        IngestOptions(keep="often").validate()


@pytest.mark.parametrize(
    "args",
    [("--keep", "often"), ("--keep", "savings", "--engine", "spark")],
    ids=["unknown-rule", "spark-engine"],
)
def test_cli_bad_keep(tmp_path: Path, args: tuple[str, ...]) -> None:
    corpus_file = tmp_path / "c.txt"
    corpus_file.write_text("def f():\n    return 1\n")
    env = {**os.environ, "CREST_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "CREST_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "crest.cli", "ingest", str(corpus_file), "--store", "s", "--tokenizer", "x", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_USAGE
    assert "Traceback" not in done.stderr and "--keep" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_expected_accepted_leave_one_out() -> None:
    # root A (weight 3) -> B (weight 2) -> C (weight 1); root D (weight 1): total 4
    blob = encode_tree(np.array([1, 2, 3, 4]), np.array([-1, 0, 1, -1]), np.array([3, 2, 1, 1]), vocab_size=VOCAB)
    assert expected_accepted(blob, n=1, table=None) == pytest.approx((3 + 2) / 4)


def test_marginal_gain_over_suffix() -> None:
    counts = np.array([10, 10])
    got = score(counts, np.array([2.0, 1.0]), suffix_expected=np.array([1.5, 1.5]))
    assert got.tolist() == pytest.approx([5.0, 0.0])


def test_choose_within_budget() -> None:
    budget = int(store_bytes(20, 2, fixed=100))  # two rows of 10 heap bytes, their hash index and 100 fixed bytes
    picked = choose(np.array([1.0, 5.0, 3.0]), np.array([10, 10, 10]), budget=budget, fixed=100)
    assert picked.tolist() == [1, 2]
    assert choose(np.array([1.0, 5.0, 3.0]), np.array([10, 10, 10]), budget=budget, fixed=110).tolist() == [1]


@pytest.mark.parametrize("selection", ["upto", "single", "combined"])
def test_keep_rules_keep_as_many_rows_per_selection(db_dsn: str, selection: str) -> None:
    # every keep rule keeps top-t rows of each n the selection mode names: upto 2 names n = 1, 2 (not 1..max_n)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, VOCAB, size=200) for _ in range(10)]  # 64 unigrams, hundreds of longer n-grams
    tokens = np.concatenate(docs).astype(np.int32)
    offsets = np.r_[0, np.cumsum([len(d) for d in docs])].astype(np.int64)
    kept = {}
    for keep in ("count", "savings", "marginal"):
        opts = IngestOptions(
            max_n=4, top_t=10, selection=selection, single_n=2, continuation_length=2, keep=keep, suffix_rule="lookup"
        )  # every selected row stays (prune would drop some)
        summary = build_store(tokens, offsets, store=keep, dsn=db_dsn, vocabulary=vocabulary(), options=opts)
        kept[keep] = summary.rows
        assert len(stored(db_dsn, keep)) == summary.rows
    ns = {"upto": 2, "single": 1, "combined": 4}[selection]
    assert kept == {"count": 10 * ns, "savings": 10 * ns, "marginal": 10 * ns}
