"""Drafters: prompt lookup, merging, the REST baseline, and the invariants every returned tree keeps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from crest_client.draft import Draft
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.drafters import MergedDrafter, PromptDrafter, StoreDrafter, build_draft, make_drafter
from crest.errors import ConfigError
from crest.rest import RestDrafter, RestIndex
from tests.fix_corpora import corpora, flatten


def check_invariants(draft: Draft | None, max_nodes: int) -> None:
    if draft is None:
        return
    draft.validate()
    assert 0 < len(draft) <= max_nodes
    assert (np.diff(draft.weights) <= 0).all()
    siblings = Counter(zip(draft.parents.tolist(), draft.tokens.tolist(), strict=True))
    assert max(siblings.values()) == 1  # no duplicate child tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=12), st.integers(1, 20))
def test_build_draft_weights_count_continuations(conts: list[list[int]], size: int) -> None:
    draft = build_draft(conts, tree_size=size)
    check_invariants(draft, size)
    assert draft is not None
    for path, w in zip(draft.paths(), draft.weights.tolist(), strict=True):
        assert w == sum(1 for c in conts if c[: len(path)] == path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_prompt_lookup_matches_brute_force(context: list[int]) -> None:
    draft = PromptDrafter(max_ngram=4, min_ngram=1, max_matches=100, length=3).draft(context, 64)
    check_invariants(draft, 64)
    size = len(context)
    for n in range(min(4, size - 1), 0, -1):
        hits = [i for i in range(size - n) if context[i : i + n] == context[size - n :]]
        if hits:
            assert draft is not None and draft.n == n
            conts = {tuple(context[h + n : h + n + 3]) for h in hits}
            assert {tuple(p) for p in draft.paths()} >= {c[:1] for c in conts}
            return
    assert draft is None


def test_merged_tree_holds_both_trees_paths() -> None:
    class Fixed:
        def __init__(self, draft: Draft) -> None:
            self.value = draft

        def draft(self, context: list[int], max_nodes: int) -> Draft:
            return self.value

    a = build_draft([[1, 2, 3], [1, 2, 4], [5]], tree_size=10, n=3)
    b = build_draft([[1, 2, 9]], tree_size=10, n=2)
    assert a is not None and b is not None
    merged = MergedDrafter(Fixed(a), Fixed(b)).draft([0], 64)
    check_invariants(merged, 64)
    assert merged is not None
    paths = {tuple(p) for p in merged.paths()}
    assert {tuple(p) for p in a.paths()} | {tuple(p) for p in b.paths()} == paths
    assert merged.tokens[0] == 1  # the path both trees share weighs most


def test_store_drafter_swallows_errors() -> None:
    class Down:
        def draft(self, context: list[int], max_nodes: int) -> Draft:
            raise OSError("connection refused")

    assert StoreDrafter(Down()).draft([1, 2], 8) is None


@pytest.mark.parametrize("name", ["rest", "crest", "crest+prompt", "nope"])
def test_make_drafter_needs_its_parts(name: str) -> None:
    with pytest.raises(ConfigError):
        make_drafter(name)


def brute_rest(docs: list[list[int]], context: list[int], length: int) -> tuple[int, list[list[int]]] | None:
    for m in range(min(16, len(context)), 1, -1):
        pat = context[-m:]
        conts = [d[i + m : i + m + length] for d in docs for i in range(len(d) - m + 1) if d[i : i + m] == pat]
        if conts:
            return m, conts
    return None


@settings(max_examples=150, deadline=None)
@given(corpora(), st.lists(st.integers(0, 5), min_size=2, max_size=20))
def test_rest_matches_brute_force(corpus: tuple[list[list[int]], int], context: list[int]) -> None:
    docs, _ = corpus
    tokens, offsets = flatten(docs)
    index = RestIndex.build(tokens, offsets)
    draft = RestDrafter(index, continuation_length=3).draft(context, 64)
    want = brute_rest(docs, context, 3)
    if want is None or not any(want[1]):
        assert draft is None
        return
    m, conts = want
    assert draft is not None and draft.n == m
    expected = build_draft([c for c in conts if c], tree_size=64, n=m)
    assert expected is not None
    assert draft.paths() == expected.paths() and draft.weights.tolist() == expected.weights.tolist()


def test_rest_save_load_and_size(tmp_path: object) -> None:
    tokens, offsets = flatten([[1, 2, 3, 4], [1, 2, 5]])
    index = RestIndex.build(tokens, offsets)
    assert index.nbytes == tokens.nbytes + 7 * 4
    index.save(tmp_path)  # type: ignore[arg-type]
    loaded = RestIndex.load(tmp_path)  # type: ignore[arg-type]
    assert loaded.sa.tolist() == index.sa.tolist()
    draft = RestDrafter(loaded).draft([9, 1, 2], 8)
    assert draft is not None and sorted(draft.tokens.tolist()) == [3, 4, 5]  # never crosses into the next document
