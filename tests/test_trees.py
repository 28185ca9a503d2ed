"""Bulk tree building against a plain-Python trie with the same rules, and the prefix-order invariant."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.ngrams import window_keys
from crest.trees import build_trees, find_occurrences, position_hash
from tests.fix_corpora import corpora, flatten


def reference_trees(
    docs: list[list[int]], ngrams: list[tuple[int, ...]], *, length: int, size: int
) -> dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]]:
    """Return, per n-gram, its kept (path, weight) nodes in order, by brute force (no sampling)."""
    out = {}
    for gram in ngrams:
        n = len(gram)
        weight: dict[tuple[int, ...], int] = defaultdict(int)
        for doc in docs:
            for i in range(len(doc) - n + 1):
                if tuple(doc[i : i + n]) == gram:
                    cont = doc[i + n : i + n + length]
                    for d in range(1, len(cont) + 1):
                        weight[tuple(cont[:d])] += 1
        # rank within each depth by (weight desc, token, parent's rank), then order by (weight desc, depth, rank)
        rank: dict[tuple[int, ...], int] = {}
        for depth in range(1, length + 1):
            level = [p for p in weight if len(p) == depth]
            level.sort(key=lambda p: (-weight[p], p[-1], rank.get(p[:-1], 0)))
            rank.update({p: i for i, p in enumerate(level)})
        nodes = sorted(weight.items(), key=lambda kv: (-kv[1], len(kv[0]), rank[kv[0]]))
        out[gram] = nodes[:size]
    return out


def batch_paths(batches: list, ngrams: np.ndarray) -> dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]]:
    out = {}
    for b in batches:
        for j, idx in enumerate(b.ngram_index.tolist()):
            lo, hi = int(b.offsets[j]), int(b.offsets[j + 1])
            toks, pars, ws = b.tokens[lo:hi].tolist(), b.parents[lo:hi].tolist(), b.weights[lo:hi].tolist()
            paths: list[tuple[int, ...]] = []
            for t, p in zip(toks, pars, strict=True):
                assert p < len(paths)  # parent before child
                paths.append((paths[p] if p >= 0 else ()) + (t,))
            assert all(ws[i] >= ws[i + 1] for i in range(len(ws) - 1))  # weights never increase
            out[tuple(ngrams[idx].tolist())] = list(zip(paths, ws, strict=True))
    return out


@settings(max_examples=150, deadline=None)
@given(corpora(), st.integers(1, 3), st.integers(1, 6), st.integers(1, 12), st.sampled_from([3, 7, 1 << 20]))
def test_trees_match_reference(corpus: tuple[list[list[int]], int], n: int, length: int, size: int, chunk: int) -> None:
    docs, vocab = corpus
    tokens, offsets = flatten(docs)
    grams = sorted({tuple(d[i : i + n]) for d in docs for i in range(len(d) - n + 1)})
    if not grams:
        return
    ngrams = np.array(grams, dtype=np.int32).reshape(-1, n)
    batches = list(
        build_trees(
            tokens,
            offsets,
            ngrams,
            n=n,
            vocab_size=vocab,
            continuation_length=length,
            tree_size=size,
            max_matches=10**9,
            chunk_tokens=chunk,
            batch_occurrences=5,
        )
    )
    got = batch_paths(batches, ngrams)
    want = reference_trees(docs, grams, length=length, size=size)
    for gram in grams:
        assert got.get(gram, []) == want[gram], gram


def test_sampling_is_uniform_deterministic_and_capped() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 3, 20000).astype(np.int32)
    offsets = np.array([0, 7000, 20000], dtype=np.int64)
    keys = window_keys(np.array([0, 1, 2], dtype=np.int64), np.arange(3), 1, 3)
    a = find_occurrences(tokens, offsets, keys, n=1, vocab_size=3, max_matches=500, seed=7, chunk_tokens=999)
    b = find_occurrences(tokens, offsets, keys, n=1, vocab_size=3, max_matches=500, seed=7, chunk_tokens=1 << 20)
    c = find_occurrences(tokens, offsets, keys, n=1, vocab_size=3, max_matches=500, seed=8, chunk_tokens=1 << 20)
    for sel, pos in (a, b, c):
        assert np.bincount(sel, minlength=3).tolist() == [500, 500, 500]
        assert (tokens[pos] == sel).all()
    pairs_a = sorted(zip(a[0].tolist(), a[1].tolist(), strict=True))
    pairs_b = sorted(zip(b[0].tolist(), b[1].tolist(), strict=True))
    assert pairs_a == pairs_b  # the sample does not depend on chunking
    assert sorted(a[1].tolist()) != sorted(c[1].tolist())  # the seed matters
    # roughly uniform over the corpus: about 7000/20000 of the sample lies in the first document
    share = (a[1] < 7000).mean()
    assert 0.28 < share < 0.42


def test_continuations_stop_at_document_end() -> None:
    docs = [[1, 2, 3], [4, 5], [1, 2]]
    tokens, offsets = flatten(docs)
    (batch,) = build_trees(tokens, offsets, np.array([[1, 2]]), n=2, vocab_size=6, continuation_length=5)
    assert batch.tokens.tolist() == [3]  # the [1, 2] at a document end continues with nothing, not with 4
    assert batch.weights.tolist() == [1]


def test_position_hash_spreads_values() -> None:
    h = position_hash(np.arange(1000), 0)
    assert len(set(h.tolist())) == 1000


@pytest.mark.parametrize("vocab", [50, 200_000], ids=["packed", "wide-vocab"])
def test_wide_vocabularies(vocab: int) -> None:
    docs = [[vocab - 1, 3, vocab - 2, vocab - 1, 3, 7]]
    tokens, offsets = flatten(docs)
    (batch,) = build_trees(tokens, offsets, np.array([[vocab - 1, 3]]), n=2, vocab_size=vocab, continuation_length=2)
    assert batch.tokens.tolist() == [7, vocab - 2, vocab - 1]  # equal weights: shallower, then smaller token
