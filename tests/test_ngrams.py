"""N-gram counting and top-t selection against plain-Python counting per document."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.ngrams import count_ngrams, select_top, unpack_keys, window_keys
from tests.fix_corpora import corpora, flatten


def reference_counts(docs: list[list[int]], n: int) -> Counter[tuple[int, ...]]:
    return Counter(tuple(d[i : i + n]) for d in docs for i in range(len(d) - n + 1))


@settings(max_examples=200, deadline=None)
@given(corpora(), st.integers(1, 5), st.sampled_from([1, 4, 9, 1 << 20]))
def test_counts_match_reference(corpus: tuple[list[list[int]], int], max_n: int, chunk: int) -> None:
    docs, vocab = corpus
    tokens, offsets = flatten(docs)
    counts = count_ngrams(tokens, offsets, max_n=max_n, vocab_size=vocab, chunk_tokens=chunk)
    for n in range(1, max_n + 1):
        want = reference_counts(docs, n)
        got = dict(zip(map(tuple, counts.ngrams(n).tolist()), counts.counts[n].tolist(), strict=True))
        assert got == dict(want)
        assert counts.positions(n) == sum(want.values())


@settings(max_examples=100, deadline=None)
@given(corpora(), st.integers(1, 4), st.integers(1, 5))
def test_top_t_is_most_common_with_lexicographic_ties(corpus: tuple[list[list[int]], int], max_n: int, t: int) -> None:
    docs, vocab = corpus
    tokens, offsets = flatten(docs)
    selected = select_top(count_ngrams(tokens, offsets, max_n=max_n, vocab_size=vocab), top_t=t)
    for n, sel in selected.items():
        want = sorted(reference_counts(docs, n).items(), key=lambda kv: (-kv[1], kv[0]))[:t]
        assert [tuple(g) for g in sel.ngrams.tolist()] == [g for g, _ in want]
        assert sel.counts.tolist() == [c for _, c in want]


@pytest.mark.parametrize(
    ("mode", "n", "lengths"), [("combined", None, [1, 2, 3]), ("single", 2, [2]), ("upto", 2, [1, 2])]
)
def test_selection_modes(mode: str, n: int | None, lengths: list[int]) -> None:
    tokens, offsets = flatten([[1, 2, 3, 1, 2, 3]])
    counts = count_ngrams(tokens, offsets, max_n=3, vocab_size=4)
    assert sorted(select_top(counts, top_t=2, mode=mode, n=n)) == lengths


@pytest.mark.parametrize("vocab", [2, 65536, 200_000, 2**31], ids=["tiny", "16-bit", "wide", "31-bit"])
def test_keys_round_trip_and_sort_lexicographically(vocab: int) -> None:
    rng = np.random.default_rng(0)
    grams = rng.integers(0, vocab, size=(200, 4))
    keys = window_keys(grams.ravel(), np.arange(0, 800, 4), 4, vocab)
    assert unpack_keys(keys, 4, vocab).tolist() == grams.tolist()
    order = np.argsort(keys, kind="stable")
    assert [tuple(g) for g in grams[order].tolist()] == sorted(map(tuple, grams.tolist()))
