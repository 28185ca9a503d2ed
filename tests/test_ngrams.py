"""N-gram counting and top-t selection against plain-Python counting per document."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.errors import ConfigError, CorpusError
from crest.ingest.ngrams import (
    NgramCounts,
    count_ngrams,
    doc_ends,
    kth_largest,
    packs,
    select_top,
    unpack_keys,
    window_keys,
)
from tests.fix_corpus import corpora, flatten

WIDE = 200_000  # 18-bit ids: 4-grams need 72 bits and take the void-key fallback
WIDE_IDS = [0, 1, 65_536, 131_071, WIDE - 1]


def reference_counts(docs: list[list[int]], n: int) -> Counter[tuple[int, ...]]:
    return Counter(tuple(d[i : i + n]) for d in docs for i in range(len(d) - n + 1))


def as_dict(counts: NgramCounts, n: int) -> dict[tuple[int, ...], int]:
    return dict(zip(map(tuple, counts.ngrams(n).tolist()), counts.counts[n].tolist(), strict=True))


@st.composite
def wide_corpora(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Draw documents over a few ids of a 200k vocabulary, so n-grams repeat and keys are wide."""
    docs = draw(st.lists(st.lists(st.sampled_from(WIDE_IDS), max_size=20), min_size=1, max_size=5))
    return docs, WIDE


def check_counts(docs: list[list[int]], vocab: int, max_n: int, chunk: int) -> None:
    tokens, offsets = flatten(docs)
    counts = count_ngrams(tokens, offsets, max_n=max_n, vocab_size=vocab, chunk_tokens=chunk)
    for n in range(1, max_n + 1):
        want = reference_counts(docs, n)
        assert as_dict(counts, n) == dict(want)
        assert counts.positions(n) == sum(want.values())
        assert counts.unique(n) == len(want)
        grams = [tuple(g) for g in counts.ngrams(n).tolist()]
        assert grams == sorted(grams)  # keys are sorted, i.e. lexicographic


@settings(max_examples=200, deadline=None)
@given(corpora(), st.integers(1, 5), st.sampled_from([1, 4, 9, 1 << 20]))
def test_counts_match_reference(corpus: tuple[list[list[int]], int], max_n: int, chunk: int) -> None:
    check_counts(*corpus, max_n=max_n, chunk=chunk)


@settings(max_examples=60, deadline=None)
@given(wide_corpora(), st.sampled_from([3, 7, 1 << 20]))
def test_wide_vocabulary_counts_match_reference(corpus: tuple[list[list[int]], int], chunk: int) -> None:
    assert packs(3, WIDE) and not packs(4, WIDE)
    check_counts(*corpus, max_n=4, chunk=chunk)


def test_many_chunks_merge_to_the_same_table() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.zipf(1.3, 5000).clip(max=300).astype(np.int32) - 1
    offsets = np.array([0, 1000, 1000, 2500, 4999, 5000], dtype=np.int64)
    whole = count_ngrams(tokens, offsets, max_n=3, vocab_size=300, chunk_tokens=1 << 20)
    parts = count_ngrams(tokens, offsets, max_n=3, vocab_size=300, chunk_tokens=37)  # 136 chunks: deep merges
    for n in (1, 2, 3):
        assert np.array_equal(whole.keys[n], parts.keys[n])
        assert np.array_equal(whole.counts[n], parts.counts[n])


@settings(max_examples=100, deadline=None)
@given(corpora(), st.integers(1, 4), st.integers(1, 5))
def test_top_t_is_most_common_with_lexicographic_ties(corpus: tuple[list[list[int]], int], max_n: int, t: int) -> None:
    docs, vocab = corpus
    tokens, offsets = flatten(docs)
    selected = select_top(count_ngrams(tokens, offsets, max_n=max_n, vocab_size=vocab), top_t=t)
    assert sorted(selected) == list(range(1, max_n + 1))
    for n, sel in selected.items():
        want = sorted(reference_counts(docs, n).items(), key=lambda kv: (-kv[1], kv[0]))[:t]
        assert [tuple(g) for g in sel.ngrams.tolist()] == [g for g, _ in want]
        assert sel.counts.tolist() == [c for _, c in want]
        assert sel.ngrams.dtype == np.int32 and sel.ngrams.shape == (len(want), n)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 5), st.integers(65_530, 65_540), st.integers(0, 10**12)), min_size=1),
    st.data(),
)
def test_kth_largest_matches_sorting(values: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(values)))
    assert kth_largest(np.array(values, dtype=np.int64), k) == sorted(values, reverse=True)[k - 1]


@pytest.mark.parametrize(
    ("mode", "n", "lengths"),
    [("combined", None, [1, 2, 3]), ("single", 2, [2]), ("upto", 2, [1, 2]), ("upto", None, [1, 2, 3])],
    ids=["combined", "single-2", "upto-2", "upto-all"],
)
def test_selection_modes(mode: str, n: int | None, lengths: list[int]) -> None:
    tokens, offsets = flatten([[1, 2, 3, 1, 2, 3]])
    counts = count_ngrams(tokens, offsets, max_n=3, vocab_size=4)
    selected = select_top(counts, top_t=2, mode=mode, n=n)
    assert sorted(selected) == lengths
    assert all(len(sel.counts) == 2 for sel in selected.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_t": 0}, "top_t"),
        ({"top_t": 2, "mode": "best"}, "unknown selection"),
        ({"top_t": 2, "mode": "single"}, "single"),
        ({"top_t": 2, "mode": "single", "n": 5}, "single"),
    ],
    ids=["zero-t", "unknown-mode", "single-without-n", "single-n-not-counted"],
)
def test_bad_selection_is_a_config_error(kwargs: dict, message: str) -> None:
    tokens, offsets = flatten([[1, 2, 3]])
    counts = count_ngrams(tokens, offsets, max_n=3, vocab_size=4)
    with pytest.raises(ConfigError, match=message):
        select_top(counts, **kwargs)


@pytest.mark.parametrize(
    ("tokens", "offsets", "message"),
    [
        ([1, 2, 9], [0, 3], "outside the vocabulary"),
        ([1, -1, 2], [0, 3], "outside the vocabulary"),
        ([1, 2, 3], [0, 2], "offsets"),
        ([1, 2, 3], [0, 2, 1, 3], "decrease"),
    ],
    ids=["id-too-large", "negative-id", "offsets-short", "offsets-decrease"],
)
def test_bad_corpus_is_a_corpus_error(tokens: list[int], offsets: list[int], message: str) -> None:
    with pytest.raises(CorpusError, match=message):
        count_ngrams(np.array(tokens, dtype=np.int32), np.array(offsets), max_n=2, vocab_size=4)


def test_progress_reports_every_position_once_per_n() -> None:
    tokens, offsets = flatten([[1, 2, 3], [], [3, 2, 1, 0, 1]])
    seen: list[int] = []
    count_ngrams(tokens, offsets, max_n=3, vocab_size=4, chunk_tokens=3, progress=seen.append)
    assert sum(seen) == 3 * len(tokens)
    assert max(seen) <= 3


def test_memmap_corpus_counts_like_an_array(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50, 3000).astype(np.int32)
    offsets = np.array([0, 700, 2999, 3000], dtype=np.int64)
    mapped = np.memmap(tmp_path / "tokens.i32", dtype=np.int32, mode="w+", shape=tokens.shape)
    mapped[:] = tokens
    mapped.flush()
    mapped = np.memmap(tmp_path / "tokens.i32", dtype=np.int32, mode="r", shape=tokens.shape)
    a = count_ngrams(tokens, offsets, max_n=2, vocab_size=50, chunk_tokens=512)
    b = count_ngrams(mapped, offsets, max_n=2, vocab_size=50, chunk_tokens=512)
    assert np.array_equal(a.keys[2], b.keys[2]) and np.array_equal(a.counts[2], b.counts[2])


def test_doc_ends_skip_empty_documents() -> None:
    offsets = np.array([0, 2, 2, 5, 5, 6], dtype=np.int64)
    assert doc_ends(offsets, 0, 6).tolist() == [2, 2, 5, 5, 5, 6]
    assert doc_ends(offsets, 2, 4).tolist() == [5, 5]


@pytest.mark.parametrize("vocab", [2, 65536, 200_000, 2**31], ids=["tiny", "16-bit", "wide", "31-bit"])
def test_keys_round_trip_and_sort_lexicographically(vocab: int) -> None:
    rng = np.random.default_rng(0)
    grams = rng.integers(0, vocab, size=(200, 4))
    keys = window_keys(grams.ravel(), np.arange(0, 800, 4), 4, vocab)
    assert unpack_keys(keys, 4, vocab).tolist() == grams.tolist()
    order = np.argsort(keys, kind="stable")
    assert [tuple(g) for g in grams[order].tolist()] == sorted(map(tuple, grams.tolist()))
