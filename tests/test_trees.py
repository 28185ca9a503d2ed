"""Bulk tree building against a plain-Python trie with the same rules, sampling, and the prefix-order invariant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.errors import ConfigError
from crest.ingest.trees import TreeBatch, build_trees, find_occurrences, lex_order, position_hash
from tests.fix_corpus import corpora, flatten

Path_ = tuple[int, ...]
Tree = list[tuple[Path_, int]]


def occurrences(docs: list[list[int]], gram: Path_) -> list[tuple[int, int]]:
    """Return (corpus position, document index) of every in-document occurrence of `gram`."""
    out, base, n = [], 0, len(gram)
    for d, doc in enumerate(docs):
        out += [(base + i, d) for i in range(len(doc) - n + 1) if tuple(doc[i : i + n]) == gram]
        base += len(doc)
    return out


def sample(found: list[tuple[int, int]], max_matches: int, seed: int) -> list[tuple[int, int]]:
    """Keep the max_matches occurrences with the smallest (seeded hash of the position, position)."""
    if len(found) <= max_matches:
        return found
    hashes = position_hash(np.array([p for p, _ in found]), seed).tolist()
    return [occ for _, occ in sorted(zip(hashes, found, strict=True))[:max_matches]]


def reference_tree(docs: list[list[int]], gram: Path_, *, length: int, size: int, max_matches: int, seed: int) -> Tree:
    """Return the kept (path, weight) nodes of `gram`'s tree, in order, from a dict-of-dicts trie."""
    starts = [sum(len(d) for d in docs[:i]) for i in range(len(docs))]
    root: dict[int, Any] = {}  # token -> {"weight": continuations through it, "kids": {...}}
    for pos, d in sample(occurrences(docs, gram), max_matches, seed):
        at = pos - starts[d] + len(gram)
        kids = root
        for tok in docs[d][at : at + length]:
            node = kids.setdefault(tok, {"weight": 0, "kids": {}})
            node["weight"] += 1
            kids = node["kids"]
    weight: dict[Path_, int] = {}
    stack: list[tuple[Path_, dict[int, Any]]] = [((), root)]
    while stack:
        path, kids = stack.pop()
        for tok, node in kids.items():
            weight[(*path, tok)] = node["weight"]
            stack.append(((*path, tok), node["kids"]))

    def order_key(path: Path_) -> tuple:
        # weight desc, depth asc, token asc, then the parent's own order key (its position in the output)
        return (-weight[path], len(path), path[-1], order_key(path[:-1]) if len(path) > 1 else ())

    kept = sorted(weight, key=order_key)[:size]
    place = {p: i for i, p in enumerate(kept)}

    def head(path: Path_) -> Path_:
        # equal-weight chains are stored together, at the place of their first (shallowest) node
        return path if len(path) == 1 or weight[path[:-1]] != weight[path] else head(path[:-1])

    return [(p, weight[p]) for p in sorted(kept, key=lambda p: (place[head(p)], len(p)))]


def batch_trees(batches: list[TreeBatch], grams: list[Path_]) -> dict[Path_, Tree]:
    """Return each n-gram's (path, weight) nodes, checking the CSR layout and the prefix-order invariant."""
    out: dict[Path_, Tree] = {}
    for b in batches:
        assert b.offsets[0] == 0 and b.offsets[-1] == len(b.tokens) and np.all(np.diff(b.offsets) >= 0)
        assert b.tokens.dtype == np.int32 and b.parents.dtype == np.int32 and b.weights.dtype == np.int64
        for j, idx in enumerate(b.ngram_index.tolist()):
            draft = b.draft(j)
            draft.validate()  # every parent comes before its child
            weights = draft.weights.tolist()
            assert all(weights[i] >= weights[i + 1] for i in range(len(weights) - 1))
            out[grams[idx]] = list(zip(map(tuple, draft.paths()), weights, strict=True))
    return out


def distinct_grams(docs: list[list[int]], n: int) -> list[Path_]:
    return sorted({tuple(d[i : i + n]) for d in docs for i in range(len(d) - n + 1)})


@settings(max_examples=150, deadline=None)
@given(
    corpora(),
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 12),
    st.sampled_from([3, 7, 1 << 20]),
    st.sampled_from([(1, 1), (5, 2), (1 << 20, 1 << 16)]),
)
def test_trees_match_reference(
    corpus: tuple[list[list[int]], int], n: int, length: int, size: int, chunk: int, batching: tuple[int, int]
) -> None:
    docs, vocab = corpus
    grams = distinct_grams(docs, n)
    if not grams:
        return
    tokens, offsets = flatten(docs)
    batch_occurrences, batch_size = batching
    batches = list(
        build_trees(
            tokens,
            offsets,
            np.array(grams, dtype=np.int32),
            n=n,
            vocab_size=vocab,
            continuation_length=length,
            tree_size=size,
            max_matches=10**9,
            chunk_tokens=chunk,
            batch_occurrences=batch_occurrences,
            batch_size=batch_size,
        )
    )
    assert all(len(b) <= batch_size for b in batches)
    assert np.concatenate([b.ngram_index for b in batches]).tolist() == list(range(len(grams)))  # in order
    got = batch_trees(batches, grams)
    for gram in grams:
        assert got[gram] == reference_tree(docs, gram, length=length, size=size, max_matches=10**9, seed=0), gram


@settings(max_examples=150, deadline=None)
@given(corpora(), st.integers(1, 2), st.integers(1, 4), st.integers(0, 3), st.booleans(), st.sampled_from([4, 1 << 20]))
def test_sampled_trees_match_reference(
    corpus: tuple[list[list[int]], int], n: int, max_matches: int, seed: int, give_counts: bool, chunk: int
) -> None:
    docs, vocab = corpus
    grams = distinct_grams(docs, n)
    if not grams:
        return
    tokens, offsets = flatten(docs)
    found = [len(occurrences(docs, g)) for g in grams]
    batches = list(
        build_trees(
            tokens,
            offsets,
            np.array(grams, dtype=np.int32),
            n=n,
            counts=np.array(found) if give_counts else None,
            vocab_size=vocab,
            continuation_length=3,
            tree_size=5,
            max_matches=max_matches,
            seed=seed,
            chunk_tokens=chunk,
        )
    )
    got = batch_trees(batches, grams)
    for gram in grams:
        assert got[gram] == reference_tree(docs, gram, length=3, size=5, max_matches=max_matches, seed=seed)
    occ = np.concatenate([b.occurrences for b in batches]).tolist()
    assert occ == found
    assert np.concatenate([b.matches for b in batches]).tolist() == [min(f, max_matches) for f in found]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 7, 131_071, 199_999]), max_size=20), min_size=1, max_size=4))
def test_wide_vocabulary_trees_match_reference(docs: list[list[int]]) -> None:
    grams = distinct_grams(docs, 4)  # 4 x 18 bits: void keys and binary-search lookup
    if not grams:
        return
    tokens, offsets = flatten(docs)
    batches = list(build_trees(tokens, offsets, np.array(grams), n=4, vocab_size=200_000, continuation_length=4))
    got = batch_trees(batches, grams)
    for gram in grams:
        assert got[gram] == reference_tree(docs, gram, length=4, size=64, max_matches=5000, seed=0)


@settings(max_examples=100, deadline=None)
@given(corpora(), st.integers(1, 2), st.integers(2, 10))
def test_every_prefix_is_the_heaviest_subtree(corpus: tuple[list[list[int]], int], n: int, size: int) -> None:
    docs, vocab = corpus
    grams = distinct_grams(docs, n)
    if not grams:
        return
    tokens, offsets = flatten(docs)
    got = batch_trees(list(build_trees(tokens, offsets, np.array(grams), n=n, tree_size=size, vocab_size=vocab)), grams)
    for gram in grams:
        full = [w for _, w in reference_tree(docs, gram, length=10, size=10**6, max_matches=10**9, seed=0)]
        best = sorted(full, reverse=True)
        nodes = got[gram]
        paths = {p for p, _ in nodes}
        for k in range(len(nodes) + 1):
            # weights never grow down a path, so the heaviest k-node subtree weighs the k largest weights
            assert sum(w for _, w in nodes[:k]) == sum(best[:k])
            assert all(p[:-1] in paths or len(p) == 1 for p, _ in nodes[:k])


def test_sampling_is_uniform_deterministic_and_capped() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 3, 20000).astype(np.int32)
    offsets = np.array([0, 7000, 20000], dtype=np.int64)
    grams = np.array([[0], [1], [2]])

    def run(seed: int, chunk: int, **kw: Any) -> list[tuple[int, int]]:
        occ = find_occurrences(tokens, offsets, grams, max_matches=500, seed=seed, chunk_tokens=chunk, **kw)
        assert np.bincount(occ.ngram, minlength=3).tolist() == [500, 500, 500]
        assert (tokens[occ.position] == occ.ngram).all()
        assert occ.found.tolist() == np.bincount(tokens, minlength=3).tolist()
        return list(zip(occ.ngram.tolist(), occ.position.tolist(), strict=True))

    a = run(7, 999)
    assert a == run(7, 1 << 20)  # the sample does not depend on chunking
    assert a == run(7, 999, counts=np.bincount(tokens, minlength=3))  # nor on being told the counts
    assert a == run(7, 999, counts=np.array([10**6, 10**6, 10**6]))  # overstated counts: rescan fallback
    assert a == run(7, 999, counts=np.array([1, 1, 1]))  # understated counts: nothing sampled early
    assert a != run(8, 1 << 20)  # the seed matters
    alone = find_occurrences(tokens, offsets, grams[1:2], max_matches=500, seed=7)
    assert alone.position.tolist() == [p for g, p in a if g == 1]  # nor on the other n-grams selected
    # roughly uniform over the corpus: about 7000/20000 of the sample lies in the first document
    share = np.mean([p < 7000 for _, p in a])
    assert 0.28 < share < 0.42


def test_continuations_stop_at_document_end() -> None:
    docs = [[1, 2, 3], [4, 5], [1, 2]]
    tokens, offsets = flatten(docs)
    (batch,) = build_trees(tokens, offsets, np.array([[1, 2]]), n=2, vocab_size=6, continuation_length=5)
    assert batch.tokens.tolist() == [3]  # the [1, 2] at a document end continues with nothing, not with 4
    assert batch.weights.tolist() == [1]
    assert batch.occurrences.tolist() == [2] and batch.matches.tolist() == [2]


def test_missing_ngrams_get_empty_trees_and_no_ngrams_no_batches() -> None:
    tokens, offsets = flatten([[1, 2, 3, 1, 2]])
    (batch,) = build_trees(tokens, offsets, np.array([[3, 3], [1, 2]]), n=2)
    assert batch.offsets.tolist() == [0, 0, 3]  # the chain 3, 1, 2; the occurrence at the end adds nothing
    assert batch.occurrences.tolist() == [0, 2]
    assert list(build_trees(tokens, offsets, np.zeros((0, 2), dtype=np.int32), n=2)) == []


def test_memmap_corpus_builds_like_an_array(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 20, 4000).astype(np.int32)
    offsets = np.array([0, 1500, 4000], dtype=np.int64)
    mapped = np.memmap(tmp_path / "tokens.i32", dtype=np.int32, mode="w+", shape=tokens.shape)
    mapped[:] = tokens
    mapped.flush()
    grams = np.array([[3, 4], [0, 0], [19, 1]])
    a = list(build_trees(tokens, offsets, grams, n=2, max_matches=5, chunk_tokens=333))
    b = list(
        build_trees(np.memmap(tmp_path / "tokens.i32", dtype=np.int32, mode="r"), offsets, grams, n=2, max_matches=5)
    )
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(getattr(x, f), getattr(y, f)) for f in ("offsets", "tokens", "parents", "weights"))


@pytest.mark.parametrize(
    ("ngrams", "kwargs", "message"),
    [
        ([[1, 2], [1, 2]], {}, "duplicates"),
        ([[1, 2]], {"tree_size": 0}, "tree_size"),
        ([[1, 2]], {"max_matches": 0}, "max_matches"),
        ([[1, 2]], {"counts": np.array([1, 2])}, "counts"),
    ],
    ids=["duplicates", "tree-size", "max-matches", "counts-length"],
)
def test_bad_arguments_are_config_errors(ngrams: list[list[int]], kwargs: dict, message: str) -> None:
    tokens, offsets = flatten([[1, 2, 3]])
    with pytest.raises(ConfigError, match=message):
        list(build_trees(tokens, offsets, np.array(ngrams), n=2, **kwargs))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**40), st.integers(0, 2**30)), max_size=30))
def test_lex_order_is_a_stable_lexicographic_sort(rows: list[tuple[int, int, int]]) -> None:
    cols = [np.array([r[i] for r in rows], dtype=np.int64) for i in range(3)]
    want = sorted(range(len(rows)), key=lambda i: (rows[i], i))
    assert lex_order(cols).tolist() == want  # 72 bits: lexsort
    assert lex_order(cols[:1]).tolist() == sorted(range(len(rows)), key=lambda i: (rows[i][0], i))  # value sort
    assert lex_order([cols[0], cols[2]]).tolist() == sorted(range(len(rows)), key=lambda i: (rows[i][::2], i))


def test_position_hash_spreads_values() -> None:
    h = position_hash(np.arange(1000), 0)
    assert len(set(h.tolist())) == 1000
    assert not np.array_equal(h, position_hash(np.arange(1000), 1))


@pytest.mark.parametrize("vocab", [50, 200_000], ids=["packed", "wide-vocab"])
def test_equal_weights_go_shallower_then_smaller_token(vocab: int) -> None:
    docs = [[vocab - 1, 3, vocab - 2, vocab - 1, 3, 7]]
    tokens, offsets = flatten(docs)
    (batch,) = build_trees(tokens, offsets, np.array([[vocab - 1, 3]]), n=2, vocab_size=vocab, continuation_length=2)
    assert batch.tokens.tolist() == [7, vocab - 2, vocab - 1]


@pytest.mark.parametrize("vocab", [40, 2**31], ids=["hashed", "void-keys-binary-search"])
def test_occurrence_lookup_finds_every_selected_ngram(vocab: int) -> None:
    rng = np.random.default_rng(4)
    ids = np.arange(10) * (vocab // 10)
    tokens = ids[rng.integers(0, 10, 6000)].astype(np.int32)
    offsets = np.array([0, 2500, 6000], dtype=np.int64)
    grams = rng.permutation(np.array([(a, b, c) for a in ids for b in ids for c in ids[::2]]))
    occ = find_occurrences(tokens, offsets, grams, vocab_size=vocab, max_matches=10**6, chunk_tokens=1000)
    docs = [tokens[:2500].tolist(), tokens[2500:].tolist()]
    assert occ.found.tolist() == [len(occurrences(docs, tuple(g))) for g in grams.tolist()]
    assert np.array_equal(occ.found, np.bincount(occ.ngram, minlength=len(grams)))
    window = np.stack([tokens[occ.position + j] for j in range(3)], axis=1)
    assert np.array_equal(window, grams[occ.ngram])


def test_equal_weight_chains_are_stored_contiguously() -> None:
    docs = [[9, 1, 2, 3], [9, 4, 5, 6], [9, 1, 7, 8]]
    tokens, offsets = flatten(docs)
    (batch,) = build_trees(tokens, offsets, np.array([[9]]), n=1, vocab_size=10, continuation_length=3)
    # weight 2: [1]; weight-1 chains in their heads' order (shallower, then smaller token): 4-5-6, 2-3, 7-8
    assert batch.tokens.tolist() == [1, 4, 5, 6, 2, 3, 7, 8]
    assert batch.parents.tolist() == [-1, -1, 1, 2, 0, 4, 0, 6]
