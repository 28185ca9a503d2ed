"""The tree each stored n-gram's row holds (`crest.ingest.suffixes`): decided at ingest, fetched in one row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import psycopg
import pytest
from crest_client import Store
from crest_client.choice import promise
from crest_client.codec import tree_nodes
from crest_client.draft import Draft
from crest_client.keyfilter import KeyFilter, hash_keys

from crest.config import IngestOptions
from crest.ingest.pipeline import IngestSummary, ingest
from crest.ingest.suffixes import BACKOFF_SCALE, backoff_share, backoff_tree, stored_order
from tests.fix_cli import run
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_learning import published, version_rows

pytest_plugins = ["tests.fix_corpus"]

WORDS = [f"w{i}" for i in range(40)]
OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=3, max_matches=50, tree_size=16)


def _chain(tokens: list[int], weight: int) -> Draft:
    return Draft(np.array(tokens), np.arange(-1, len(tokens) - 1, dtype=np.int32), np.full(len(tokens), weight), 2)


def test_backoff_share_trusts_common_ngrams_with_few_followers() -> None:
    assert backoff_share(1000, 1, max_matches=5000) > 0.99
    assert backoff_share(2, 2, max_matches=5000) == 0.5
    assert backoff_share(10**6, 10, max_matches=100) == 100 / 110  # trees are built from max_matches at most


def test_backoff_tree_holds_both_paths_weighted_by_the_share() -> None:
    own, suffix = _chain([5, 6], 3), _chain([7, 8], 40)
    tree = backoff_tree(own, suffix, count=3, options=OPTIONS)  # lam = 3 / (3 + 1)
    assert tree.n == own.n and sorted(tree.tokens.tolist()) == [5, 6, 7, 8]
    weights = dict(zip(tree.tokens.tolist(), tree.weights.tolist(), strict=True))
    assert weights[5] == round(0.75 * BACKOFF_SCALE) and weights[7] == round(0.25 * BACKOFF_SCALE)
    assert backoff_tree(own, None, count=3, options=OPTIONS) is own


def test_stored_order_keeps_equal_weight_chains_contiguous() -> None:
    tree = Draft(np.array([1, 2, 3, 4]), np.array([-1, -1, 0, 1], dtype=np.int32), np.array([5, 5, 5, 5]), 1)
    ordered = stored_order(tree)
    assert ordered.tokens.tolist() == [1, 3, 2, 4] and ordered.parents.tolist() == [-1, 0, -1, 2]


@pytest.fixture
def backoff_store(db_dsn: str, tmp_path: Path) -> str:
    """Two stores of one corpus: `own` (each row its own tree) and `backoff` (decided at ingest)."""
    tokenizer = make_word_tokenizer(tmp_path / "tok", WORDS)
    # "w1 w2" is followed by w3 many times; "w9 w1 w2" once, by w4: its back-off tree also drafts w3
    docs = [{"text": "w1 w2 w3 w5"}] * 12 + [{"text": "w9 w1 w2 w4 w6"}]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    for name, rule in (("own", "lookup"), ("backoff", "backoff")):
        options = IngestOptions(**{**OPTIONS.__dict__, "suffix_rule": rule})
        ingest([str(corpus)], store=name, tokenizer=str(tokenizer), dsn=db_dsn, options=options)
    return db_dsn


def test_a_rare_ngram_backs_off_to_its_suffix_in_one_row(backoff_store: str) -> None:
    ids = {w: i + 2 for i, w in enumerate(WORDS)}  # the word tokenizer's ids
    context = [ids["w9"], ids["w1"], ids["w2"]]
    with Store.connect(backoff_store, "own", timeout=2.0, rule="longest") as own:
        assert own.info.params["suffix_rule"] == "lookup"
        thin = own.draft(context)
        assert thin is not None and int(thin.tokens[0]) == ids["w4"] and ids["w3"] not in thin.tokens.tolist()
    with Store.connect(backoff_store, "backoff", timeout=2.0) as decided:  # the default client rule, `expected`
        assert decided.info.params["suffix_rule"] == "backoff"
        tree = decided.draft(context)
        assert tree is not None and tree.n == 3
        weights = dict(zip(tree.tokens.tolist(), tree.weights.tolist(), strict=True))
        # one occurrence, one follower: lam = 1/2; the suffix "w1 w2" (13 occurrences) drafts w3 12 times, w4 once
        # (within one: the suffix's own tree was decided, and rounded, first)
        assert abs(weights[ids["w4"]] - (0.5 + 0.5 / 13) * BACKOFF_SCALE) <= 1
        assert abs(weights[ids["w3"]] - 0.5 * 12 / 13 * BACKOFF_SCALE) <= 1
        assert decided.stats["queries"] == 1


def test_lookup_says_where_the_matched_rows_tree_came_from(
    backoff_store: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CREST_DATABASE_URL", backoff_store)
    code, out, err = run(monkeypatch, capsys, "lookup", "--store", "backoff", "w9 w1 w2", "--json")
    found = json.loads(out)
    assert code == 0 and found["n"] == 3, err
    assert found["source"] == (
        "decided at ingest (backoff): its own occurrences (seen 1) backed off to its suffixes' "
        "(n=2: seen 13, n=1: seen 13)"
    )
    code, out, _ = run(monkeypatch, capsys, "lookup", "--store", "own", "w9 w1 w2", "--rule", "longest")
    assert code == 0 and "tree: its own occurrences (the longest rule chose this suffix at lookup)" in " ".join(
        out.split()
    )


def test_spark_refuses_backoff_and_a_judgeless_auto_before_any_work() -> None:
    from crest.errors import ConfigError
    from crest.ingest.publishing import check_ingest, check_judge

    options = IngestOptions(top_t=10, suffix_rule="backoff")
    with pytest.raises(
        ConfigError, match="--engine spark stores each n-gram's own tree only, not --suffix-rule backoff"
    ):
        check_ingest(options, store="s", engine="spark")
    assert check_ingest(options, store="s").suffix_rule == "backoff"
    auto = check_ingest(IngestOptions(top_t=10, suffix_rule="auto"), store="s", engine="spark")
    check_judge(auto, judged=True, engine="spark")  # auto runs on Spark with a judge (tests/test_spark.py)
    with pytest.raises(ConfigError, match="on --suffix-judge only"):  # its held-out trial build runs in process
        check_judge(auto, judged=False, engine="spark")
    check_judge(auto, judged=False)
    pruned = IngestOptions(top_t=10, suffix_rule="prune")  # prune runs on Spark too (tests/test_spark.py)
    assert check_ingest(pruned, store="s", engine="spark").suffix_rule == "prune"
    with pytest.raises(ConfigError, match="unknown --suffix-rule 'merged'"):
        check_ingest(IngestOptions(top_t=10, suffix_rule="merged"), store="s")


def _corpus(seed: int) -> list[dict[str, str]]:
    """Return documents of 12 words: a few repeated phrases (long matches, ties) among Zipf-like words."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 12, size=int(rng.integers(2, 6))).tolist() for _ in range(6)]
    docs = []
    for _ in range(60):
        words: list[int] = []
        while len(words) < int(rng.integers(4, 30)):
            words += phrases[int(rng.integers(6))] if rng.random() < 0.4 else [min(11, int(rng.zipf(1.5)) - 1)]
        docs.append({"text": " ".join(WORDS[w] for w in words)})
    return docs


def _prune_stores(dsn: str, tmp_path: Path, seed: int) -> dict[str, IngestSummary]:
    """Build `own` (each row its own tree) and `pruned` (--suffix-rule prune) from one random corpus."""
    tokenizer = make_word_tokenizer(tmp_path / "tok", WORDS)
    corpus = write_jsonl(tmp_path / "c.jsonl", _corpus(seed))
    out = {}
    for name, rule in (("own", "lookup"), ("pruned", "prune")):
        options = IngestOptions(**{**OPTIONS.__dict__, "max_n": 4, "max_matches": 20, "suffix_rule": rule})
        out[name] = ingest([str(corpus)], store=name, tokenizer=str(tokenizer), dsn=dsn, options=options)
    return out


def _same(a: Draft | None, b: Draft | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.n == b.n and all(
        np.array_equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.weights, b.weights))
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_pruned_store_drafts_what_expected_drafts_on_the_whole_store(
    db_dsn: str, tmp_path: Path, seed: int
) -> None:
    _prune_stores(db_dsn, tmp_path, seed)
    rng = np.random.default_rng(100 + seed)
    docs = [[WORDS.index(w) + 2 for w in d["text"].split()] for d in _corpus(seed)]
    differs = 0
    with (
        Store.connect(db_dsn, "own", timeout=5.0, rule="expected", cache_size=0) as own,
        Store.connect(db_dsn, "own", timeout=5.0, rule="longest", cache_size=0) as longest,
        Store.connect(db_dsn, "pruned", timeout=5.0, rule="longest", cache_size=0) as pruned,
    ):
        for i in range(250):
            doc = docs[int(rng.integers(len(docs)))]
            end = int(rng.integers(1, len(doc) + 1))
            context = [int(t) for t in rng.integers(2, 14, size=int(rng.integers(0, 3)))] + doc[max(0, end - 5) : end]
            if i % 5 == 0:  # some contexts of random words only
                context = rng.integers(2, 14, size=int(rng.integers(1, 6))).tolist()
            want = own.draft(context)
            assert _same(pruned.draft(context), want), f"context {context}: the pruned store drafts another tree"
            differs += not _same(longest.draft(context), want)
    assert differs > 10, "the contexts must exercise suffixes where `expected` and `longest` disagree"


def test_pruned_rows_are_absent_and_counted(db_dsn: str, tmp_path: Path) -> None:
    summaries = _prune_stores(db_dsn, tmp_path, 4)
    ids = published(db_dsn, "own")["static"], published(db_dsn, "pruned")["static"]
    whole, left = (version_rows(db_dsn, sid) for sid in ids)
    by_key = {key: (n, count, tree) for n, key, count, tree in whole}
    width = len(min(by_key, key=len))

    def score(key: bytes) -> tuple[float, int]:  # the `expected` rule's key of a row
        n, count, tree = by_key[key]
        return promise(n, count, tree, max_matches=20), n

    # restated: a row stays when it beats every stored proper suffix of it, so some context drafts from it
    shorter = {key: [key[c:] for c in range(width, len(key), width) if key[c:] in by_key] for key in by_key}
    kept = {key for key in by_key if all(score(key) > score(s) for s in shorter[key])}
    assert {key for _, key, _, _ in left} == kept and kept < set(by_key)
    assert {len(k) // width for k in set(by_key) - kept} == {2, 3, 4}, "every length above 1 loses rows"
    assert all(len(k) // width == 1 for k in by_key if not shorter[k]) and not any(
        len(k) // width == 1 for k in set(by_key) - kept
    )
    summary = summaries["pruned"]
    assert summary.kept == {n: sum(len(k) // width == n for k in kept) for n in range(1, 5)}
    assert summary.covered == {n: sum(c for m, k, c, _ in left if m == n) for n in range(1, 5)}
    assert summary.blob_bytes == sum(len(t) for *_, t in left)
    assert summary.avg_tree_nodes == sum(tree_nodes(t) for *_, t in left) / len(left)
    assert summary.counted == summaries["own"].counted and summary.table_bytes < summaries["own"].table_bytes
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT key_filter FROM crest_store_data WHERE store_id = %s", (ids[1],)).fetchone()
        figures = conn.execute("SELECT figures FROM crest_stores WHERE id = %s", (ids[1],)).fetchone()
    assert (
        row is not None and figures is not None and figures[0]["kept"] == {str(n): summary.kept[n] for n in range(1, 5)}
    )
    grams = [np.frombuffer(k, dtype=f">u{width}").astype(np.int64).reshape(1, -1) for k in sorted(kept)]
    hashes = np.concatenate([hash_keys(g) for g in grams])
    assert bytes(row[0]) == KeyFilter.build(hashes).to_bytes(), "the key filter holds the kept keys only"


def test_an_unknown_suffix_rule_is_refused_by_the_cli(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = make_word_tokenizer(tmp_path / "tok", WORDS)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "w1 w2 w3"}])
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    monkeypatch.setenv("CREST_BUILD_SUFFIX_RULE", "pruned")
    code, _, err = run(monkeypatch, capsys, "ingest", str(corpus), "--store", "s", "--tokenizer", str(tokenizer))
    assert code == 2 and "unknown --suffix-rule 'pruned': use lookup, backoff, prune or auto" in err
    assert "Traceback" not in err


def test_lookup_says_the_pruned_stores_row_is_the_expected_rules_choice(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _prune_stores(db_dsn, tmp_path, 1)
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    code, out, err = run(monkeypatch, capsys, "lookup", "--store", "pruned", "w0 w1", "--json")
    found = json.loads(out)
    assert code == 0 and found["n"] >= 1, err
    assert found["source"].startswith("its own occurrences (seen ")
    assert "kept at ingest (prune): the suffix the expected rule chooses" in found["source"]
