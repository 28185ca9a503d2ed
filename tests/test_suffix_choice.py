"""`--suffix-rule auto` (`crest.ingest.suffix_choice`): the rule chosen on a held-out slice of the corpus itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client import Store

from crest.config import IngestOptions
from crest.decoding.tokenizer import load_tokenizer
from crest.drafters.text_lookup import tree_source
from crest.errors import ConfigError
from crest.ingest.novelty import novel_positions
from crest.ingest.pipeline import build_store
from crest.ingest.publishing import Vocabulary
from crest.ingest.suffix_choice import HELD_FRACTION, choose_rule, split_held_out
from crest.ingest.suffixes import prune_mask
from tests.fix_cli import run
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_judged import CHOICE_WORDS, choice_options, row_of, word_corpus, word_offsets, word_phrases
from tests.fix_learning import published, version_rows


def test_split_holds_out_whole_documents_seeded() -> None:
    lengths = [100 + d % 7 for d in range(300)]
    offsets = word_offsets(lengths)
    tokens = np.arange(int(offsets[-1]), dtype=np.int32)  # token i at position i: documents are recognisable
    bt, bo, ht, ho = split_held_out(tokens, offsets, seed=3)
    docs = [tuple(tokens[offsets[d] : offsets[d + 1]].tolist()) for d in range(300)]
    built = [tuple(bt[bo[d] : bo[d + 1]].tolist()) for d in range(bo.shape[0] - 1)]
    held = [tuple(ht[ho[d] : ho[d + 1]].tolist()) for d in range(ho.shape[0] - 1)]
    assert sorted(built + held) == docs and set(built).isdisjoint(held)
    assert len(held) >= 1 and int(ho[-1]) - max(lengths) < HELD_FRACTION * int(offsets[-1]) <= int(ho[-1])
    assert [d.tolist() for d in split_held_out(tokens, offsets, seed=3)] == [
        bt.tolist(),
        bo.tolist(),
        ht.tolist(),
        ho.tolist(),
    ]
    assert split_held_out(tokens, offsets, seed=4)[2].tolist() != ht.tolist()
    one = split_held_out(tokens[:100], word_offsets([100]), seed=3)
    assert one[0].tolist() == tokens[:100].tolist() and one[3].tolist() == [0]  # one document: nothing held out


@pytest.mark.parametrize(("follows", "rule"), [(11, "longest"), (10, "prune")])
def test_the_rule_whose_tree_the_held_out_text_follows_is_chosen(follows: int, rule: str) -> None:
    # "1" is followed by 10 five hundred times; "2 1" once, by 11: `expected` (and so prune) drafts 10 after "2 1"
    rows = [row_of([1], 10, 500), row_of([2, 1], 11, 1)]
    keep = prune_mask(rows, width=2, max_matches=5000)
    assert keep == [True, False]
    held = (np.array([2, 1, follows], dtype=np.int32), word_offsets([3]))
    choice = choose_rule(rows, keep, held, width=2, max_n=4, length=3, table=None, seed=0)
    assert choice.rule == rule and choice.positions == 2  # after "2" (nothing stored) and after "2 1"
    assert (choice.m_longest, choice.m_prune) == ((1.5, 1.0) if rule == "longest" else (1.0, 1.5))


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20], ids=["chunk-1", "chunk-3", "one-chunk"])
def test_novel_positions_are_those_whose_window_the_build_never_holds(chunk: int) -> None:
    build = (np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 2], dtype=np.int32), word_offsets([9, 3]))
    held_docs = [
        [1, 2, 3, 4, 5, 6, 7],  # every 4-token window is a build window: nothing novel
        [1, 2, 3, 4, 5, 0, 7],  # the windows through the 0 are new
        [8, 9, 9, 1],  # spans the end of a build document and the start of the next: not a build window
    ]
    held = (np.concatenate([np.array(d, dtype=np.int32) for d in held_docs]), word_offsets([len(d) for d in held_docs]))
    novel = novel_positions(build, held, window=2, chunk_tokens=chunk)
    # [p - 2, p + 2) inside the document: p in 2..len - 2 of each; the 0 sits at 5 in document 2
    assert np.flatnonzero(novel).tolist() == [7 + 4, 7 + 5, 14 + 2]


def test_a_large_judge_is_read_as_a_seeded_sample_of_whole_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    from crest.ingest import suffix_choice

    lengths = [30 + d % 11 for d in range(50)]
    offsets = word_offsets(lengths)
    tokens = np.arange(int(offsets[-1]), dtype=np.int32)
    assert suffix_choice.sample_judge(tokens, offsets, seed=0)[0] is tokens  # under the cap: all of it
    monkeypatch.setattr(suffix_choice, "HELD_TOKENS", 200)
    got, at = suffix_choice.sample_judge(tokens, offsets, seed=0)
    docs = {tuple(tokens[offsets[d] : offsets[d + 1]].tolist()) for d in range(50)}
    sampled = [tuple(got[at[d] : at[d + 1]].tolist()) for d in range(at.shape[0] - 1)]
    assert set(sampled) <= docs and len(set(sampled)) == len(sampled)  # whole documents, each once
    assert 200 <= int(at[-1]) < 200 + max(lengths)
    assert suffix_choice.sample_judge(tokens, offsets, seed=0)[0].tolist() == got.tolist()
    assert suffix_choice.sample_judge(tokens, offsets, seed=1)[0].tolist() != got.tolist()


def test_novel_positions_without_windows_or_build() -> None:
    held = (np.array([1, 2, 3], dtype=np.int32), word_offsets([3]))
    assert not novel_positions((np.zeros(0, np.int32), word_offsets([])), held, window=2).any()  # no full window
    novel = novel_positions((np.zeros(0, np.int32), np.zeros(1, np.int64)), held, window=1)
    assert novel.tolist() == [False, True, True]  # an empty build holds no window


def test_only_novel_positions_are_judged() -> None:
    # the build repeats "2 1 11": "2 1" has a thin tree (11), "1" a rich one (10, 500 times). Held out: the repeat
    # (every window seen: longest is right there), then "2 1 10 3", whose windows after "2 1" are new (prune is right)
    rows = [row_of([1], 10, 500), row_of([2, 1], 11, 1)]
    keep = prune_mask(rows, width=2, max_matches=5000)
    copies = [2, 1, 11] * 4
    held = (np.array(copies + [2, 1, 10, 3], dtype=np.int32), word_offsets([len(copies), 4]))
    build = (np.array(copies * 3, dtype=np.int32), word_offsets([3 * len(copies)]))
    novel = novel_positions(build, held, window=1)
    assert np.flatnonzero(novel).tolist() == [len(copies) + 2, len(copies) + 3]  # [1, 10] and [10, 3]
    kw: dict[str, Any] = {"width": 2, "max_n": 4, "length": 3, "table": None, "seed": 0}
    every, judged = choose_rule(rows, keep, held, **kw), choose_rule(rows, keep, held, novel=novel, **kw)
    assert (every.rule, every.novel) == ("longest", False) and every.positions == len(copies) - 1 + 3
    assert (judged.rule, judged.novel, judged.positions) == ("prune", True, 2)
    nothing_new = choose_rule(rows, keep, held, novel=np.zeros_like(novel), **kw)
    assert (nothing_new.rule, nothing_new.novel, nothing_new.positions) == (every.rule, False, every.positions)


def test_a_tie_keeps_prune_the_smaller() -> None:
    rows = [row_of([1], 10, 500), row_of([2, 1], 11, 1)]
    held = (np.array([3, 3, 3], dtype=np.int32), word_offsets([3]))  # no stored suffix anywhere
    choice = choose_rule(rows, [True, False], held, width=2, max_n=4, length=3, table=None, seed=0)
    assert choice.rule == "prune" and choice.m_prune == choice.m_longest == 1.0


def _assert_rows_of_the_rule(
    db_dsn: str, vocabulary: Vocabulary, corpus: tuple[np.ndarray, np.ndarray], store: str, rule: str, *, seed: int
) -> tuple[int, int]:
    """Assert `store` holds the rows a build of the whole corpus with `rule` holds; return both version ids."""
    same = "prune" if rule == "prune" else "lookup"  # `longest` keeps every row, as `lookup` builds them
    build_store(*corpus, store="same", dsn=db_dsn, vocabulary=vocabulary, options=choice_options(seed, same))
    ids = published(db_dsn, store)["static"], published(db_dsn, "same")["static"]
    assert version_rows(db_dsn, ids[0]) == version_rows(db_dsn, ids[1])
    return ids


# repeated phrases: long n-grams are right, `longest` wins; Zipf noise alone: thin long trees lose to `expected`
@pytest.mark.parametrize(("seed", "phrases_share", "want"), [(0, 0.5, "longest"), (1, 0.0, "prune")])
def test_auto_publishes_the_chosen_rules_store_of_the_build_documents(
    db_dsn: str, tmp_path: Path, seed: int, phrases_share: float, want: str
) -> None:
    spec = str(make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS))
    vocabulary = Vocabulary.of(load_tokenizer(spec), spec)
    rng = np.random.default_rng(seed)
    tokens, offsets = word_corpus(rng, word_phrases(rng), phrases_share, 300)
    got = build_store(
        tokens, offsets, store="auto", dsn=db_dsn, vocabulary=vocabulary, options=choice_options(seed, "auto")
    )
    choice = got.suffix_choice
    assert choice is not None and choice["rule"] == want and choice["positions"] > 50 and choice["novel"], choice
    assert got.tokens == int(offsets[-1])  # the trial held a slice out; the store holds every document
    ids = _assert_rows_of_the_rule(db_dsn, vocabulary, (tokens, offsets), "auto", choice["rule"], seed=seed)
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT params, figures FROM crest_stores WHERE id = %s", (ids[0],)).fetchone()
    assert row is not None
    params, figures = row
    assert params["suffix_rule"] == "auto" and figures["suffix_choice"] == choice
    key = next(k for n, k, _, _ in sorted(version_rows(db_dsn, ids[0])) if n == 2)
    with Store.connect(db_dsn, "auto", cache_size=0, timeout=5.0) as handle:  # what `crest lookup` says
        suffix = np.frombuffer(key, dtype=f">u{handle.info.token_width}").tolist()
        source = tree_source(db_dsn, handle, suffix, handle.rule)
    said = "the rule auto chose at ingest" if want == "longest" else "kept at ingest (auto: prune)"
    assert said in source, source


# the judge text decides, not the corpus: Zipf noise alone follows `expected`'s rich trees; the phrases alone, in new
# orders (new windows), follow the long n-grams' thin trees
@pytest.mark.parametrize(
    ("judge_share", "want"), [(0.0, "prune"), (1.0, "longest")], ids=["noise-judge", "phrase-judge"]
)
def test_a_judge_corpus_chooses_on_the_whole_build(db_dsn: str, tmp_path: Path, judge_share: float, want: str) -> None:
    spec = str(make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS))
    vocabulary = Vocabulary.of(load_tokenizer(spec), spec)
    rng = np.random.default_rng(0)
    phrases = word_phrases(rng)
    tokens, offsets = word_corpus(rng, phrases, 0.5, 300)
    judge = word_corpus(np.random.default_rng(7), phrases, judge_share, 40)
    got = build_store(
        tokens,
        offsets,
        store="judged",
        dsn=db_dsn,
        vocabulary=vocabulary,
        options=choice_options(0, "auto"),
        judge=judge,
    )
    choice = got.suffix_choice
    assert choice is not None and choice["judged_on"] == "judge" and choice["rule"] == want, choice
    assert choice["held_tokens"] == int(judge[1][-1]) and choice["novel"] and got.tokens == int(offsets[-1])
    _assert_rows_of_the_rule(db_dsn, vocabulary, (tokens, offsets), "judged", want, seed=0)


def test_a_judge_corpus_needs_auto(db_dsn: str, tmp_path: Path) -> None:
    spec = str(make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS))
    tokens, offsets = word_corpus(np.random.default_rng(0), word_phrases(np.random.default_rng(0)), 0.5, 20)
    with pytest.raises(ConfigError, match="give --suffix-rule auto"):
        build_store(
            tokens,
            offsets,
            store="s",
            dsn=db_dsn,
            vocabulary=Vocabulary.of(load_tokenizer(spec), spec),
            options=IngestOptions(top_t=10, suffix_rule="prune"),
            judge=(tokens, offsets),
        )


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--suffix-rule", "prune"], "--suffix-judge is the text --suffix-rule auto chooses its rule on"),
        (["--suffix-rule", "auto", "--suffix-judge", "missing.jsonl"], "--suffix-judge: input "),
    ],
    ids=["without-auto", "missing-judge"],
)
def test_the_cli_refuses_a_bad_judge_and_builds_nothing(
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    said: str,
) -> None:
    tokenizer = make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "w1 w2 w3"}])
    judge = write_jsonl(tmp_path / "j.jsonl", [{"text": "w1 w2"}])
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    monkeypatch.chdir(tmp_path)
    args = ["ingest", str(corpus), "--store", "s", "--tokenizer", str(tokenizer), "--suffix-judge", str(judge)]
    code, _, err = run(monkeypatch, capsys, *args, *extra)
    assert code == 2 and said in err and "Traceback" not in err, err
    with psycopg.connect(db_dsn) as conn:
        built = conn.execute("SELECT to_regclass('crest_stores') IS NOT NULL").fetchone() == (True,)
        assert not built or conn.execute("SELECT count(*) FROM crest_stores WHERE name = 's'").fetchone() == (0,)


def test_the_ingest_summary_says_what_auto_chose(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS)
    rng = np.random.default_rng(0)
    tokens, offsets = word_corpus(rng, word_phrases(rng), 0.5, 60)
    docs = [{"text": " ".join(f"w{t}" for t in tokens[offsets[d] : offsets[d + 1]])} for d in range(60)]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    judge = write_jsonl(tmp_path / "j.jsonl", docs[:5])  # part of the corpus: no novel position
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    args = ["ingest", str(corpus), "--store", "s", "--tokenizer", str(tokenizer), "--top-t", "50", "-q"]
    code, out, err = run(monkeypatch, capsys, *args, "--suffix-rule", "auto", "--suffix-judge", str(judge))
    assert code == 0, err
    said = " ".join(out.translate({ord(c): " " for c in "│┃┌┐└┘├┤┬┴┼─━"}).split())  # the table's cells, unwrapped
    assert (
        "suffix rule" in said and "auto chose " in said and "(none novel: every one judged) of --suffix-judge" in said
    )
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0 and "auto chose" not in out
