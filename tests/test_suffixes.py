"""The tree each stored n-gram's row holds (`crest.ingest.suffixes`): decided at ingest, fetched in one row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from crest_client import Store
from crest_client.draft import Draft

from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from crest.ingest.suffixes import BACKOFF_SCALE, backoff_share, backoff_tree, stored_order
from tests.fix_cli import run
from tests.fix_corpus import make_word_tokenizer, write_jsonl

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


def test_spark_refuses_the_backoff_rule_before_any_work() -> None:
    from crest.errors import ConfigError
    from crest.ingest.publishing import check_ingest

    options = IngestOptions(top_t=10, suffix_rule="backoff")
    with pytest.raises(ConfigError, match="--engine spark stores each n-gram's own tree only"):
        check_ingest(options, store="s", engine="spark")
    assert check_ingest(options, store="s").suffix_rule == "backoff"
    with pytest.raises(ConfigError, match="unknown --suffix-rule 'merged'"):
        check_ingest(IngestOptions(top_t=10, suffix_rule="merged"), store="s")
