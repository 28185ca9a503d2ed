"""The REST baseline (`crest.drafters.suffix_array`): suffix sorting against Python's sort, drafting against a
brute-force REST over the documents (longest suffix, in-document continuations, the trie), sampling, save/load,
the cheap check of an index directory, and sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from crest.drafters.suffix_array import RestDrafter, RestIndex, check_rest_index, sort_suffixes
from crest.errors import ConfigError, CorpusError
from tests.fix_corpus import corpora, flatten
from tests.fix_drafts import check_invariants, reference_tree, same


def in_doc_key(tokens: np.ndarray, offsets: np.ndarray, pos: int, width: int) -> list[int]:
    end = int(offsets[np.searchsorted(offsets, pos, side="right")])
    return tokens[pos : min(pos + width, end)].tolist()


@settings(max_examples=200, deadline=None)
@given(corpora(), st.sampled_from([1, 2, 3, 5, 17]), st.sampled_from([1, 1 << 20]))
def test_sort_suffixes_equals_python_sort(corpus: tuple[list[list[int]], int], width: int, scale: int) -> None:
    docs, _ = corpus
    tokens, offsets = flatten([[t * scale for t in d] for d in docs])  # big ids take the prefix-doubling path
    got = sort_suffixes(tokens, offsets, key_length=width)
    want = sorted(range(tokens.shape[0]), key=lambda i: (in_doc_key(tokens, offsets, i, width), i))
    assert got.tolist() == want


def test_sort_suffixes_large_vocabulary_and_repeats() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, size=3000).astype(np.int32)
    tokens[1000:1300] = tokens[:300]  # long repeats: ties past 17 tokens stay in position order
    tokens[2000:2040] = 7
    offsets = np.array([0, 1100, 1100, 2020, 3000])
    got = sort_suffixes(tokens, offsets, key_length=17)
    assert got.tolist() == sorted(range(3000), key=lambda i: (in_doc_key(tokens, offsets, i, 17), i))


def brute_rest(docs: list[list[int]], context: list[int], length: int) -> tuple[int, list[list[int]]] | None:
    """REST's Algorithm 1 over documents: longest suffix (16 down to 2) with an occurrence followed by a token."""
    for m in range(min(16, len(context)), 1, -1):
        pat = context[len(context) - m :]
        conts = [d[i + m : i + m + length] for d in docs for i in range(len(d) - m) if d[i : i + m] == pat]
        if conts:
            return m, conts
    return None


@st.composite
def corpus_and_context(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Documents and a context that often ends with a piece of one of them, so long matches happen."""
    docs, vocab = draw(corpora())
    head = draw(st.lists(st.integers(0, vocab), max_size=4))
    source = draw(st.sampled_from(docs))
    a = draw(st.integers(0, len(source)))
    b = draw(st.integers(a, min(len(source), a + 18)))
    return docs, head + source[a:b] + draw(st.lists(st.integers(0, vocab), max_size=1))


@settings(max_examples=300, deadline=None)
@given(corpus_and_context(), st.integers(1, 4), st.integers(1, 64))
def test_rest_draft_equals_brute_force(case: tuple[list[list[int]], list[int]], length: int, size: int) -> None:
    docs, context = case
    index = RestIndex.build(*flatten(docs))
    draft = RestDrafter(index, continuation_length=length).draft(context, size)
    check_invariants(draft, size)
    want = brute_rest(docs, context, length)
    if want is None:
        assert draft is None
        return
    m, conts = want
    assert draft is not None and same(draft, reference_tree(conts, size, m))


@st.composite
def crowded(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Long documents over two or three tokens and a short context: suffixes with many occurrences."""
    vocab = draw(st.integers(2, 3))
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=8, max_size=40), min_size=1, max_size=4))
    return docs, draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=3))


@settings(max_examples=150, deadline=None)
@given(crowded(), st.integers(1, 6), st.booleans())
def test_rest_sampling_when_matches_exceed_the_limit(
    case: tuple[list[list[int]], list[int]], cut: int, spread: bool
) -> None:
    docs, context = case
    want = brute_rest(docs, context, 3)
    assume(want is not None and len(want[1]) > 1)
    assert want is not None
    limit = min(cut, len(want[1]) - 1)
    m, conts = want
    tokens, offsets = flatten(docs)
    index = RestIndex.build(tokens, offsets)
    draft = RestDrafter(index, max_matches=limit, continuation_length=3, spread=spread).draft(context, 64)
    assert draft is not None and draft.n == m
    # occurrences in suffix-array order: by their in-document key of m + 1 + 16 tokens, then position
    starts = [i for i in range(tokens.shape[0]) if in_doc_key(tokens, offsets, i, m + 1)[:m] == context[-m:]]
    starts = [i for i in starts if len(in_doc_key(tokens, offsets, i, m + 1)) == m + 1]
    starts.sort(key=lambda i: (in_doc_key(tokens, offsets, i, 17), i))
    picks = [starts[k * len(starts) // limit] for k in range(limit)] if spread else starts[:limit]
    picked = [in_doc_key(tokens, offsets, i, m + 3)[m:] for i in picks]
    assert same(draft, reference_tree(picked, 64, m))


def test_rest_never_crosses_a_document_end() -> None:
    tokens, offsets = flatten([[1, 2, 3, 4], [1, 2], [5, 1, 2, 6, 7], [8, 9, 1, 2]])
    index = RestIndex.build(tokens, offsets)
    draft = RestDrafter(index).draft([9, 9, 1, 2], 64)
    assert draft is not None and draft.n == 2  # "9 1 2" ends its document: no continuation, so not a match
    assert sorted(map(tuple, draft.paths())) == [(3,), (3, 4), (6,), (6, 7)]
    assert RestDrafter(index).draft([3, 4, 8], 64) is None  # "4 8" would straddle two documents
    assert RestDrafter(index, min_suffix=3).draft([0, 1, 2], 64) is None
    assert RestDrafter(index).draft([1], 64) is None
    assert RestDrafter(index).draft([5, 1, 2], 0) is None


def test_rest_match_ranges() -> None:
    tokens, offsets = flatten([[1, 2, 3], [1, 2], [4, 1, 2, 3]])
    index = RestIndex.build(tokens, offsets)
    lo, hi = index.match_range([1, 2])
    assert hi - lo == 3 and sorted(index.sa[lo:hi].tolist()) == [0, 3, 6]
    lo, hi = index.match_range([1, 2], continued=True)
    assert sorted(index.sa[lo:hi].tolist()) == [0, 6]
    assert index.match_range([2, 3, 4]) == index.match_range([2, 3, 4])[:1] * 2  # empty
    assert index.longest_match([4, 1, 2]) == (3, *index.match_range([4, 1, 2], continued=True))
    assert index.longest_match([7, 7]) == (0, 0, 0)
    with pytest.raises(ValueError):
        index.match_range([])


def test_rest_save_load_and_size(tmp_path: Path) -> None:
    tokens, offsets = flatten([[1, 2, 3, 4], [], [1, 2, 5], [2, 3]])
    index = RestIndex.build(tokens, offsets)
    assert index.nbytes == 4 * 9 + 4 * 9 and index.sa.dtype == np.int32 and len(index) == 9
    index.save(tmp_path / "ix")
    loaded = RestIndex.load(tmp_path / "ix")
    assert isinstance(loaded.tokens, np.memmap) and isinstance(loaded.sa, np.memmap)
    assert loaded.sa.tolist() == index.sa.tolist() and loaded.tokens.tolist() == tokens.tolist()
    assert loaded.doc_offsets.tolist() == offsets.tolist() and loaded.nbytes == index.nbytes
    for context in ([9, 1, 2], [2], [0, 2, 3], [1, 2, 3]):
        a, b = RestDrafter(index).draft(context, 8), RestDrafter(loaded).draft(context, 8)
        assert (a is None and b is None) or (a is not None and b is not None and same(a, b))
    got = RestDrafter(loaded).draft([9, 1, 2], 8)
    assert got is not None and sorted(got.tokens.tolist()) == [3, 4, 5]


def test_rest_empty_corpus_and_bad_inputs(tmp_path: Path) -> None:
    empty = RestIndex.build(np.zeros(0, dtype=np.int32), np.array([0]))
    assert empty.nbytes == 0 and RestDrafter(empty).draft([1, 2, 3], 8) is None
    with pytest.raises(CorpusError):
        RestIndex.build(np.array([1, 2, 3]), np.array([0, 2]))  # offsets do not end at the token count
    with pytest.raises(CorpusError):
        RestIndex.build(np.array([1, -2, 3]), np.array([0, 3]))
    with pytest.raises(ConfigError):
        RestIndex.load(tmp_path)  # not an index directory
    RestIndex.build(np.array([1, 2, 3]), np.array([0, 3])).save(tmp_path / "ix")
    assert check_rest_index(tmp_path / "ix")["tokens"] == 3
    (tmp_path / "ix" / "sa.npy").write_bytes(b"garbage")
    with pytest.raises(ConfigError):
        RestIndex.load(tmp_path / "ix")
    for meta in ('{"format": 999}', "[1]", "not json"):
        (tmp_path / "ix" / "meta.json").write_text(meta)
        with pytest.raises(ConfigError, match="is not a REST index directory"):
            check_rest_index(tmp_path / "ix")


DOCS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox is quick.",
    "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]


@pytest.mark.slow
def test_rest_and_prompt_drafts_on_real_tokens(smollm2_gguf: Path) -> None:
    from crest.decoding.tokenizer import load_tokenizer
    from crest.drafters.merged import MergedDrafter
    from crest.drafters.prompt import PromptDrafter

    tok = load_tokenizer(smollm2_gguf)
    docs = [tok.encode(d) for d in DOCS]
    index = RestIndex.build(*flatten(docs))
    rest = RestDrafter(index)
    for doc in docs:
        for cut in range(3, len(doc) - 1, 5):
            draft = rest.draft(doc[:cut], 64)
            check_invariants(draft, 64)
            assert draft is not None and doc[cut] in draft.tokens[draft.parents < 0].tolist()
    context = tok.encode("Write it again: " + DOCS[2] + "import json\n\ndef")
    merged = MergedDrafter(rest, PromptDrafter()).draft(context, 16)
    check_invariants(merged, 16)
    want = tok.encode(" load(path):")
    assert merged is not None and merged.paths()[len(want) - 1] == want  # both trees agree on this path
