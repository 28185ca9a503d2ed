"""Drafters: the weighted-trie builder, prompt lookup, merging, the store adapter, and the tree order every
returned draft keeps (weight desc, depth, token, parent's position: parents first, prefixes are subtrees)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np
import psycopg
import pytest
from crest_client.draft import Draft, path_probabilities
from crest_client.errors import CodecError, ConnectionUnavailable, InvalidName, StoreNotFound
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.decoding.drafter import Drafter, NoneDrafter
from crest.drafters.dense import DenseDrafter, HiddenMerged
from crest.drafters.dense_index import Neighbours
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.registry import check_drafter, crest_names, make_drafter, open_drafter
from crest.drafters.store import PendingStore, StoreDrafter
from crest.drafters.suffix_array import RestDrafter, RestIndex
from crest.drafters.trie import (
    MERGE_SCALE,
    _as_rows,
    _large_draft,
    _select,
    _small_draft,
    _trie_nodes,
    build_draft,
    match_path,
    merge_drafts,
    score_draft,
)
from crest.errors import ConfigError, CrestClientError
from tests.fix_drafts import check_invariants, reference_tree, same

BIG = 1 << 20  # token ids past 16 bits exercise the byte-wise row sort


continuation_sets = st.lists(st.lists(st.integers(0, 4), max_size=7), max_size=14)


@settings(max_examples=300, deadline=None)
@given(continuation_sets, st.integers(1, 30), st.booleans())
def test_build_draft_equals_reference_trie(conts: list[list[int]], size: int, big_ids: bool) -> None:
    if big_ids:
        conts = [[BIG * t + t for t in c] for c in conts]
    draft = build_draft(conts, tree_size=size, n=3)
    check_invariants(draft, size)
    assert same(draft, reference_tree([c for c in conts if c], size, 3))


@pytest.mark.parametrize("builder", [_small_draft, _large_draft], ids=["dict", "numpy"])
@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), max_size=6), min_size=1, max_size=120),
    st.integers(1, 70),
    st.sampled_from([1, BIG]),
)
def test_both_trie_builders_equal_reference(builder: object, conts: list[list[int]], size: int, scale: int) -> None:
    conts = [[scale * t for t in c] for c in conts]
    rows = _as_rows(conts)
    if not rows.shape[0]:
        return
    draft = builder(rows, tree_size=size, n=1)  # type: ignore[operator]
    check_invariants(draft, size)
    assert same(draft, reference_tree([c for c in conts if c], size, 1))


@settings(max_examples=150, deadline=None)
@given(continuation_sets, st.integers(1, 30), st.randoms(use_true_random=False))
def test_build_draft_input_forms_and_prefixes(conts: list[list[int]], size: int, rnd: object) -> None:
    full = build_draft(conts, tree_size=1000)
    width = max((len(c) for c in conts), default=0)
    padded = np.full((len(conts), width), -1, dtype=np.int64)
    for i, c in enumerate(conts):
        padded[i, : len(c)] = c
    shuffled = list(conts)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert same(build_draft(padded, tree_size=1000), full)
    assert same(build_draft([np.array(c, dtype=np.int32) for c in shuffled], tree_size=1000), full)
    assert same(build_draft(conts, tree_size=size), full.truncate(size))  # a prefix slice is the best subtree


def test_build_draft_padding_and_empty_inputs() -> None:
    rows = np.array([[3, -1, 7], [3, 4, -1], [-1, 5, 5]])  # a row ends at its first pad
    draft = build_draft(rows, tree_size=10)
    assert draft.paths() == [[3], [3, 4]] and draft.weights.tolist() == [2, 1]
    assert len(build_draft([], tree_size=5, n=2)) == 0
    assert len(build_draft([[], []], tree_size=5)) == 0
    assert len(build_draft([[1, 2]], tree_size=0)) == 0
    with pytest.raises(ValueError, match="negative"):
        build_draft([[1, -5]])


def brute_prompt(context: list[int], max_ngram: int, min_ngram: int, matches: int, length: int) -> Draft | None:
    size = len(context)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        hits = [i for i in range(size - n) if context[i : i + n] == context[size - n :]]
        if hits:
            conts = [context[h + n : h + n + length] for h in reversed(hits)][:matches]
            return reference_tree(conts, 64, n)
    return None


prompt_options = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(1, 5))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), prompt_options)
def test_prompt_lookup_equals_brute_force(context: list[int], options: tuple[int, int, int, int]) -> None:
    import crest.drafters.prompt as prompt

    top, low, matches, length = options
    low = min(low, top)
    want = brute_prompt(context, top, low, matches, length)
    for few in (prompt._FEW, 0):  # a last token seen a few times (lists), and often (numpy)
        with patch.object(prompt, "_FEW", few):
            drafter = PromptDrafter(max_ngram=top, min_ngram=low, max_matches=matches, continuation_length=length)
            draft = drafter.draft(context, 64)
        check_invariants(draft, 64)
        assert (draft is None) == (want is None)
        if draft is not None and want is not None:
            assert same(draft, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=6)), min_size=1, max_size=12))
def test_prompt_lookup_state_follows_growing_and_new_contexts(steps: list[tuple[bool, list[int]]]) -> None:
    drafter, context = PromptDrafter(min_ngram=1), [5]
    for grow, tokens in steps:
        context = context + tokens if grow else tokens  # the verifier grows one list; a new request starts over
        got = drafter.draft(np.array(context, dtype=np.int64) if len(context) % 2 else context, 16)
        want = PromptDrafter(min_ngram=1).draft(list(context), 16)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert same(got, want)


def test_prompt_lookup_takes_most_recent_matches_of_the_longest_suffix() -> None:
    context = [7, 1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3, 6, 1, 2, 3]
    draft = PromptDrafter(max_ngram=8, min_ngram=2, max_matches=1, continuation_length=3).draft(context, 64)
    assert draft is not None and draft.n == 3  # "1 2 3", not the more frequent "2 3"
    assert draft.paths() == [[5], [5, 9], [5, 9, 2]]  # after the most recent earlier "1 2 3"
    assert PromptDrafter().draft([1, 2, 3, 4], 64) is None
    assert PromptDrafter().draft([1, 2, 1, 2], 0) is None
    with pytest.raises(ConfigError):
        PromptDrafter(min_ngram=3, max_ngram=2)


def test_prompt_lookup_says_where_its_text_goes_on_after_a_chain_copied_after_its_deepest_match() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    context = [1, 2, *text, 3, *text[:4]]  # the text again: its first 4 tokens match (max_ngram 4)
    drafter = PromptDrafter(max_ngram=4, min_ngram=2, max_matches=2, continuation_length=3)
    draft = drafter.draft(context, 64)
    assert draft is not None and draft.n == 4 and draft.paths()[-1] == [14, 15, 16]
    assert drafter.source_at([14, 15, 16], context_length=len(context)) == 9  # where 17 is, in the earlier text
    assert drafter.source_at([14, 15], context_length=len(context)) == 8
    assert drafter.source_at([14, 99], context_length=len(context)) == -1  # not what the text holds
    assert drafter.source_at([14, 15, 16], context_length=len(context) + 1) == -1  # not the last draft's context
    assert MergedDrafter(Fixed(None), drafter).source_at([14, 15, 16], context_length=len(context)) == 9
    shallow = PromptDrafter(max_ngram=8, min_ngram=2, max_matches=2, continuation_length=3)
    assert shallow.draft(context, 64) is not None  # a 4-token match, short of its deepest length (8)
    assert shallow.source_at([14, 15, 16], context_length=len(context)) == -1


class Fixed:
    """A drafter that always proposes the same tree (or raises)."""

    def __init__(self, draft: Draft | None = None, error: Exception | None = None) -> None:
        self.value, self.error, self.calls = draft, error, 0

    def draft(self, context_ids: object, max_nodes: int) -> Draft | None:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return None if self.value is None else self.value.truncate(max_nodes)


@settings(max_examples=200, deadline=None)
@given(continuation_sets, continuation_sets, st.integers(1, 80), st.floats(0.1, 4.0))
def test_merged_tree_holds_both_paths_with_summed_estimates(
    a_conts: list[list[int]], b_conts: list[list[int]], size: int, share: float
) -> None:
    a, b = build_draft(a_conts, tree_size=40, n=4), build_draft(b_conts, tree_size=40, n=2)
    merged = MergedDrafter(Fixed(a), Fixed(b), secondary_share=share).draft([0], size)
    check_invariants(merged, size)
    if not len(a) and not len(b):
        assert merged is None
        return
    assert merged is not None and merged.n == (4 if len(a) else 2)
    paths = {tuple(p): w for p, w in zip(merged.paths(), merged.weights.tolist(), strict=True)}
    a_cut, b_cut = a.truncate(size), b.truncate(size)
    both = {tuple(p) for p in a_cut.paths()} | {tuple(p) for p in b_cut.paths()}
    assert set(paths) <= both and (len(paths) == size or set(paths) == both)

    def estimate(tree: Draft, path: tuple[int, ...]) -> float:
        found = dict(zip(map(tuple, tree.paths()), tree.weights.tolist(), strict=True))
        return found.get(path, 0) / max(1, int(tree.weights[tree.parents < 0].sum()))

    for path, w in paths.items():
        want = estimate(a_cut, path) + share * estimate(b_cut, path)
        assert w == max(1, round(MERGE_SCALE * want))


def test_merged_prefers_shared_paths_and_survives_a_failing_part(caplog: pytest.LogCaptureFixture) -> None:
    a = build_draft([[1, 2, 3], [1, 2, 4], [5], [6]], tree_size=10, n=3)
    b = build_draft([[5, 9], [5, 9]], tree_size=10, n=2)
    merged = MergedDrafter(Fixed(a), Fixed(b)).draft([0], 64)
    assert merged is not None and merged.paths()[0] == [5]  # 1/4 + 1 beats 2/4
    broken = MergedDrafter(Fixed(error=RuntimeError("boom")), Fixed(b))
    with caplog.at_level(logging.WARNING, logger="crest.drafters"):
        for _ in range(3):
            got = broken.draft([0], 64)
            assert got is not None and got.paths() == [[5], [5, 9]]
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1
    assert MergedDrafter(Fixed(None), Fixed(None)).draft([0], 64) is None


def test_merge_drafts_repairs_weights_that_grow_downwards() -> None:
    odd = Draft(np.array([1, 2, 3]), np.array([-1, 0, 1], dtype=np.int32), np.array([2, 5, 9]), 1)
    merged = merge_drafts([odd], tree_size=8)
    check_invariants(merged, 8)
    assert merged.paths() == [[1], [1, 2], [1, 2, 3]]


def test_merged_estimates_keep_their_shares() -> None:

    tree = build_draft([[1, 2], [1, 3], [4]], tree_size=8, n=1)
    half = merge_drafts([tree], shares=[0.5], tree_size=8)  # a part trusted half as much predicts half
    np.testing.assert_allclose(path_probabilities(half), 0.5 * path_probabilities(tree), rtol=1e-5)
    double = merge_drafts([tree, tree], tree_size=8)  # estimates above 1 are normalised as before
    np.testing.assert_allclose(path_probabilities(double), path_probabilities(tree), rtol=1e-5)


@pytest.mark.parametrize(
    "error",
    [
        CodecError("corrupt blob"),
        ConnectionUnavailable("database down"),
        psycopg.OperationalError("server closed the connection"),
        psycopg.errors.QueryCanceled("statement timeout"),
        TimeoutError("timed out"),
    ],
    ids=["corrupt-row", "db-down", "psycopg-operational", "query-timeout", "timeout"],
)
def test_store_drafter_turns_store_errors_into_no_draft(error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    store = Fixed(error=error)
    drafter = StoreDrafter(store)
    with caplog.at_level(logging.DEBUG, logger="crest.drafters"):
        assert drafter.draft([1, 2], 8) is None
        assert drafter.draft([1, 2, 3], 8) is None
    assert store.calls == 2 and drafter.failures == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # logged once


def test_store_drafter_passes_trees_and_bugs_through() -> None:
    class Store:
        def __init__(self) -> None:
            self.asked: list[tuple[list[int], int]] = []

        def draft(self, context_ids: list[int], max_nodes: int = 64) -> Draft | None:
            self.asked.append((list(context_ids), max_nodes))
            return build_draft([[1, 2, 3], [1, 4]], tree_size=64, n=2)

    store = Store()
    got = StoreDrafter(store).draft([7, 8], 2)
    assert store.asked == [([7, 8], 2)]
    assert got is not None and got.paths() == [[1], [1, 2]]  # never more than max_nodes
    with pytest.raises(ZeroDivisionError):  # a bug is not a store failure: the verifier sees it
        StoreDrafter(Fixed(error=ZeroDivisionError())).draft([1], 8)


@pytest.fixture()
def rest_dir(tmp_path: Path) -> Path:
    """A saved REST index over two tiny documents."""
    index = RestIndex.build(np.array([1, 2, 3, 1, 2, 4], dtype=np.int32), np.array([0, 3, 6]))
    index.save(tmp_path / "rest")
    return tmp_path / "rest"


KINDS = {"none": NoneDrafter, "prompt": PromptDrafter, "rest": RestDrafter, "crest": StoreDrafter}
KINDS |= {"crest+prompt": MergedDrafter, "dense": DenseDrafter}
KINDS |= {"crest+dense": HiddenMerged, "crest+dense+prompt": HiddenMerged}


class Neighbour:
    """A dense part whose nearest stored state continues with the context's last token 1, then 5 6."""

    def search(self, hidden: np.ndarray, *, k: int) -> list[Neighbours]:
        return [[([1, 5, 6], 0.9)] for _ in hidden]


def test_crest_names_are_every_kind_crest_registers() -> None:
    assert set(crest_names()) == set(KINDS)  # the dense kinds too (registered from crest.drafters.dense)
    assert set(crest_names("vllm")) == set(KINDS) - {"rest"}


@pytest.mark.parametrize("name", crest_names())
def test_make_drafter_builds_each_name(name: str, rest_dir: Path) -> None:
    store = Fixed(build_draft([[4, 5]], tree_size=8, n=1))
    context = [9, 1, 2, 9, 1]
    for index in (RestIndex.load(rest_dir), str(rest_dir)):  # an open index or its directory
        drafter = make_drafter(f" {name.upper()}", store=store, rest_index=index, dense_index=Neighbour())
        assert type(drafter) is KINDS[name] and isinstance(drafter, Drafter)
        if "dense" in name:
            drafter.observe_hidden(len(context), np.zeros(4, dtype=np.float32))  # type: ignore[attr-defined]
        got = drafter.draft(context, 8)
        check_invariants(got, 8)
        if "dense" in name:
            assert got is not None and [5, 6] in got.paths()
    if name == "rest":
        got = make_drafter(name, rest_index=rest_dir).draft([0, 1, 2], 8)
        assert got is not None and sorted(got.tokens.tolist()) == [3, 4]


@pytest.mark.parametrize(
    ("name", "parts", "message"),
    [
        ("rest", {}, "--drafter rest needs --rest-index DIR"),
        ("crest", {"rest_index": "x"}, "--drafter crest needs --store NAME"),
        ("crest+prompt", {}, "--drafter crest[+]prompt needs --store NAME"),
        ("nope", {}, "unknown drafter 'nope': use one of none, prompt, rest, crest, crest[+]prompt"),
        ("", {}, "unknown drafter ''"),
    ],
    ids=["rest-no-index", "crest-no-store", "merged-no-store", "unknown", "empty"],
)
def test_the_registry_refuses_missing_parts(name: str, parts: dict[str, Any], message: str) -> None:
    for call in (make_drafter, check_drafter, open_drafter):
        with pytest.raises(ConfigError, match=message):
            call(name, **parts)


@pytest.mark.parametrize(
    ("name", "parts", "error", "message"),
    [
        ("crest", {"store": "x; DROP TABLE crest_stores"}, InvalidName, "not a plain identifier"),
        ("rest", {"rest_index": "/nonexistent/rest"}, ConfigError, "is not a REST index directory"),
        ("rest", {"rest_index": "."}, ConfigError, "is not a REST index directory"),
    ],
    ids=["bad-store-name", "missing-index", "not-an-index"],
)
def test_check_drafter_refuses_bad_parts_without_opening_them(
    name: str, parts: dict[str, str], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        check_drafter(name, **parts)


def test_check_drafter_names_the_drafter(rest_dir: Path) -> None:
    assert check_drafter(" Crest+Prompt", store="demo") == "crest+prompt"
    assert check_drafter("rest", rest_index=rest_dir) == "rest"
    assert check_drafter("none", store="ignored; not checked") == "none"


@pytest.mark.parametrize("name", ["none", "prompt", "rest"])
def test_open_drafter_opens_what_needs_no_database(name: str, rest_dir: Path) -> None:
    drafter = open_drafter(name, rest_index=str(rest_dir))
    assert type(drafter) is KINDS[name]


def test_a_pending_store_tries_the_database_at_most_once_per_interval() -> None:
    attempts: list[float] = []

    def down() -> object:
        attempts.append(time.monotonic())
        raise ConnectionUnavailable("connection refused")

    start = time.monotonic()
    pending = PendingStore(down, name="demo", retry_interval=0.2)
    drafter = StoreDrafter(pending)
    deadline = start + 60  # the bound is generous: a loaded machine only makes the tries sparser
    while len(attempts) < 3 and time.monotonic() < deadline:
        assert drafter.draft([1, 2], 8) is None
        time.sleep(0.005)
    assert len(attempts) == 3, "the pending store stopped trying the database"
    assert attempts[0] - start >= 0.2, "the first try came before one interval"
    assert all(b - a >= 0.2 for a, b in zip(attempts, attempts[1:], strict=False)), attempts


def test_a_pending_store_stops_trying_when_the_database_refuses_the_store(caplog: pytest.LogCaptureFixture) -> None:
    attempts = 0
    answer: Exception = ConnectionUnavailable("connection refused")

    def connect() -> object:
        nonlocal attempts
        attempts += 1
        raise answer

    pending = PendingStore(connect, name="demo", retry_interval=0.0)
    answer = StoreNotFound("no published store named 'demo'")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and attempts < 5:
        assert pending.draft([1], 8) is None
        time.sleep(0.01)
    assert attempts == 1, "a store the database refused was tried again"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot be used" in warnings[0] and "no published store" in warnings[0]


TREE = Draft(  # the paths [5], [5, 7], [5, 8], [5, 7, 9], [6], [5, 7, 9, 1]
    np.array([5, 6, 7, 8, 9, 1], dtype=np.int64),
    np.array([-1, -1, 0, 0, 2, 4], dtype=np.int32),
    np.array([9, 3, 6, 2, 5, 1], dtype=np.int64),
)


@pytest.mark.parametrize(
    ("tokens", "path"),
    [([5, 7, 9, 1], [0, 2, 4, 5]), ([5, 8, 2], [0, 3]), ([6, 7], [1]), ([4], []), ([5, 7], [0, 2]), ([], [])],
    ids=["whole-branch", "second-child", "other-root", "miss", "shorter-than-tree", "nothing-known"],
)
def test_match_path_follows_the_tokens(tokens: list[int], path: list[int]) -> None:
    assert match_path(TREE, tokens) == path
    assert score_draft(TREE, tokens)[0] == len(path)


def test_match_path_takes_the_deepest_of_duplicate_children() -> None:
    twins = Draft(np.array([5, 5, 7]), np.array([-1, -1, 1], dtype=np.int32), np.array([2, 2, 1]))
    assert match_path(twins, [5, 7]) == [1, 2]


@settings(max_examples=200, deadline=None)
@given(continuation_sets, st.integers(1, 80))
def test_the_small_and_the_array_orders_agree(conts: list[list[int]], size: int) -> None:
    small = _small_draft(_as_rows(conts), tree_size=size, n=1)
    tokens, parents, weights, depth = _trie_nodes(_as_rows(conts), tree_size=len(conts) * 12 + 1)
    large = _select(tokens, parents, weights, depth, tree_size=size, n=1)
    assert small.paths() == large.paths() and small.weights.tolist() == large.weights.tolist()


def test_score_draft_counts_the_path_the_target_took() -> None:
    tree = build_draft([[1, 2, 3], [1, 2, 4], [5, 6]], tree_size=10, n=1)
    assert score_draft(tree, [1, 2, 4, 9])[0] == 3
    assert score_draft(tree, [1, 7])[0] == 1
    assert score_draft(tree, [9])[0] == 0
    right, predicted = score_draft(tree, [1])  # only depth 1 counts: 2/3 + 1/3
    assert right == 1 and predicted == pytest.approx(1.0)


def test_merged_drafter_learns_which_part_is_right() -> None:
    target = list(range(100, 160))  # the tokens the target goes on to produce

    class Oracle:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
            at = target.index(context_ids[-1]) + 1
            return build_draft([target[at : at + 4]], tree_size=max_nodes, n=1)

    class Wrong:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
            return build_draft([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]], tree_size=max_nodes, n=2)

    merged = MergedDrafter(Wrong(), Oracle(), secondary_share=0.5)
    k = 1
    first = merged.draft([7, *target[:k]], 64)
    assert first is not None and first.paths()[0] == [1]  # no evidence yet: 2/3 beats 0.5 x 1
    for _ in range(20):
        k += 2  # the verifier appends two of the target's tokens per step
        draft = merged.draft([7, *target[:k]], 64)
    wrong, right = merged.scales()
    assert wrong < 0.2 and right > 0.9
    assert draft is not None and draft.paths()[0] == [target[k]]  # the oracle's path now leads
    assert merged.draft([1, 2, 3], 64) is not None  # a new request: nothing scored
    assert merged.scales() == (wrong, right)  # what was learned stays


def test_a_registered_kind_runs_where_it_says_and_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new drafter is one `register` call: the server, generate and the benches then know it, where it may run."""
    from crest.drafters import registry

    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    echo = registry.Kind("echo", (), lambda _: PromptDrafter(max_ngram=2), runs=frozenset({"serve", "vllm"}))
    registry.register(echo)
    assert "echo" in registry.names("serve") and "echo" not in registry.names("generate")
    assert check_drafter(" ECHO", where="serve") == "echo"
    assert isinstance(make_drafter("echo"), PromptDrafter)
    with pytest.raises(ConfigError, match=r"here \(generate\).*none, prompt, rest"):
        check_drafter("echo", where="generate")
    with pytest.raises(ConfigError, match="taken"):
        registry.register(echo)
    with pytest.raises(ConfigError, match="unknown parts"):
        registry.register(registry.Kind("gpu", ("a_gpu",), lambda _: NoneDrafter()))


@pytest.mark.parametrize(
    ("name", "where", "given", "error"),
    [
        ("rest", "serve", {}, r"unknown drafter 'rest' here \(serve\)"),
        ("rest", "generate", {}, "needs --rest-index"),
        ("crest+prompt", "vllm", {}, "needs --store NAME"),
        ("crest", None, {"store": "not a name"}, "store name"),
    ],
    ids=["rest-not-served", "rest-without-index", "crest-without-store", "bad-store-name"],
)
def test_check_drafter_refuses_before_opening_anything(
    name: str, where: str | None, given: dict[str, str], error: str
) -> None:
    with pytest.raises((ConfigError, CrestClientError), match=error):
        check_drafter(name, where=where, **given)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=7), min_size=1, max_size=10),
    tree_size=st.integers(1, 40),
    cut=st.integers(1, 40),
    share=st.sampled_from([1.0, 0.5, 0.3, 1.7]),
)
def test_one_part_merged_alone_is_what_the_whole_merge_gives(
    rows: list[list[int]], tree_size: int, cut: int, share: float
) -> None:
    import crest_client.merge as merge

    width = max(len(r) for r in rows)
    tree = build_draft(np.array([r + [-1] * (width - len(r)) for r in rows]), tree_size=tree_size)
    fast = merge.merge_drafts([tree, None], shares=[share, 1.0], tree_size=cut)
    original, merge._scaled = merge._scaled, lambda *a, **k: None
    try:
        slow = merge.merge_drafts([tree, None], shares=[share, 1.0], tree_size=cut)
    finally:
        merge._scaled = original
    assert fast.tokens.tolist() == slow.tokens.tolist() and fast.parents.tolist() == slow.parents.tolist()
    assert fast.weights.tolist() == slow.weights.tolist() and (fast.n, fast.total) == (slow.n, slow.total)


@pytest.mark.parametrize(
    ("tokens", "parents", "weights", "share"),
    [
        ([1, 0], [-1, -1], [3, 2], 1e-7),  # both scale to weight 1: the tie puts token 0 first
        ([4, 4, 5], [-1, -1, 0], [2, 1, 1], 1.0),  # two siblings with one token: one node
        ([2, 3, 1], [-1, 0, -1], [5, 1, 2], 1.0),  # a stored tree's chain order: canonical is 2, 1, 3
    ],
    ids=["ties-after-scaling", "twin-siblings", "chain-order"],
)
def test_one_part_merged_alone_edge_cases(
    tokens: list[int], parents: list[int], weights: list[int], share: float
) -> None:
    import crest_client.merge as merge

    tree = Draft(np.array(tokens), np.array(parents, dtype=np.int32), np.array(weights))
    fast = merge.merge_drafts([tree], shares=[share], tree_size=8)
    with patch.object(merge, "_scaled", lambda *a, **k: None):
        slow = merge.merge_drafts([tree], shares=[share], tree_size=8)
    assert fast.tokens.tolist() == slow.tokens.tolist() and fast.parents.tolist() == slow.parents.tolist()
    assert fast.weights.tolist() == slow.weights.tolist() and (fast.n, fast.total) == (slow.n, slow.total)


@settings(deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=7), min_size=1, max_size=10),
    cut=st.integers(1, 40),
    share=st.sampled_from([1.0, 0.5, 1e-7, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_one_part_in_any_order_merged_alone_is_what_the_whole_merge_gives(
    rows: list[list[int]], cut: int, share: float, seed: int
) -> None:
    """A stored tree comes in its chain order, not the canonical one, and a tiny share makes weights tie."""
    import crest_client.merge as merge

    width = max(len(r) for r in rows)
    tree = build_draft(np.array([r + [-1] * (width - len(r)) for r in rows]), tree_size=64)
    rng, order, ready = np.random.default_rng(seed), [], [i for i in range(len(tree)) if tree.parents[i] < 0]
    while ready:  # a random order in which parents still come first
        order.append(ready.pop(int(rng.integers(len(ready)))))
        ready += [i for i in range(len(tree)) if tree.parents[i] == order[-1]]
    place = {old: new for new, old in enumerate(order)}
    shuffled = Draft(
        tree.tokens[order], np.array([place.get(int(tree.parents[i]), -1) for i in order], dtype=np.int32),
        tree.weights[order], tree.n,
    )  # fmt: skip
    fast = merge.merge_drafts([None, shuffled], shares=[1.0, share], tree_size=cut)
    with patch.object(merge, "_scaled", lambda *a, **k: None):
        slow = merge.merge_drafts([None, shuffled], shares=[1.0, share], tree_size=cut)
    assert fast.tokens.tolist() == slow.tokens.tolist() and fast.parents.tolist() == slow.parents.tolist()
    assert fast.weights.tolist() == slow.weights.tolist() and (fast.n, fast.total) == (slow.n, slow.total)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=7), min_size=1, max_size=8), min_size=1, max_size=3
    ),
    shares=st.lists(st.sampled_from([1.0, 0.5, 0.05, 1.7]), min_size=3, max_size=3),
    depth=st.integers(1, 8),
)
def test_the_merged_chain_is_as_good_as_the_best_path_of_the_whole_merged_tree(
    parts: list[list[list[int]]], shares: list[float], depth: int
) -> None:
    """`merge_chain` finds the best path without building the merged tree: its expected accepted tokens (the sum of
    its path probabilities, as the merged tree has them) are the best path's of the whole tree."""
    from crest_client.merge import merge_chain

    from crest.integrations.chain import best_chain

    trees = []
    for rows in parts:
        width = max(len(r) for r in rows)
        trees.append(build_draft(np.array([r + [-1] * (width - len(r)) for r in rows]), tree_size=64))
    whole = merge_drafts(trees, shares=shares[: len(trees)], tree_size=10_000)
    want = best_chain(whole, depth=depth)
    got = merge_chain(trees, shares=shares[: len(trees)], depth=depth)
    assert len(got) <= depth and got.parents.tolist() == list(range(-1, len(got) - 1))
    assert float(path_probabilities(got).sum()) == pytest.approx(float(path_probabilities(want).sum()), rel=1e-9)
    on_tree = {tuple(p) for p in whole.paths()}
    assert tuple(got.tokens.tolist()) in on_tree  # a path of the merged tree, with its weights
    where = {tuple(p): i for i, p in enumerate(whole.paths())}
    assert got.weights.tolist()[-1] == int(whole.weights[where[tuple(got.tokens.tolist())]])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=7), min_size=1, max_size=8),
    share=st.sampled_from([1.0, 0.5, 0.05, 1.7]),
    depth=st.integers(1, 8),
    heavy_child=st.booleans(),
    twin=st.booleans(),
)
def test_a_chain_from_one_part_equals_the_merged_tries(
    rows: list[list[int]], share: float, depth: int, heavy_child: bool, twin: bool
) -> None:
    """One part drafted (the usual row): `merge_chain` skips the trie and gives the chain the trie would, bit for
    bit, also when a child outweighs its parent or two siblings share a token (then it builds the trie)."""
    from crest_client import merge

    width = max(len(r) for r in rows)
    tree = build_draft(np.array([r + [-1] * (width - len(r)) for r in rows]), tree_size=64, n=3)
    weights, tokens, parents = tree.weights.copy(), tree.tokens.copy(), tree.parents.copy()
    if heavy_child and len(tree) > 1:
        weights[-1] = weights[0] * 3  # the merge clamps it to its parent's
    if twin and len(tree) > 1 and parents[-1] == parents[-2]:
        tokens[-1] = tokens[-2]  # two siblings with one token: one node in the trie
    tree = Draft(tokens, parents, weights, tree.n)
    got = merge.merge_chain([tree, None], shares=[share, 1.0], depth=depth)
    with patch.object(merge, "_alone", lambda *a, **k: None):
        want = merge.merge_chain([tree, None], shares=[share, 1.0], depth=depth)
    assert got.tokens.tolist() == want.tokens.tolist() and got.weights.tolist() == want.weights.tolist()
    assert (got.n, got.total) == (want.n, want.total)


def test_a_merged_drafter_hands_its_best_path_alone_when_asked_for_a_chain() -> None:
    from crest.decoding.policy import DraftPolicy
    from crest.integrations.chain import best_chain

    stored = build_draft([[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7, 8]], tree_size=32, n=3)
    prompt = build_draft([[1, 2, 9, 9, 9]], tree_size=32, n=2)
    policy = DraftPolicy(budget=32, adaptive=False)
    drafter = MergedDrafter(Fixed(stored), Fixed(prompt))
    chain = policy.draft(drafter, [0, 1, 2], room=8, chain=True)
    tree = policy.draft(MergedDrafter(Fixed(stored), Fixed(prompt)), [0, 1, 2], room=8)
    assert chain.tokens.tolist() == [1, 2, 9, 9, 9]  # both parts agree on 1 2 9 9: the prompt's goes on
    assert chain.tokens.tolist() == best_chain(tree, depth=8).tokens.tolist()
    assert path_probabilities(chain).tolist() == pytest.approx(path_probabilities(best_chain(tree, depth=8)).tolist())
    assert policy.draft(drafter, [0, 1, 2], room=3, chain=True).tokens.tolist() == [1, 2, 9]
    assert drafter.last_trees(3) is not None  # the parts' trees are kept for the per-part counts, as for a tree
