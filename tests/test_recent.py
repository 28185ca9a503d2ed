"""The recent tier's index (crest.drafters.recent): matches at any depth, most recent first, never across documents,
continuations as long as the match is deep, eviction beyond its capacity, and folds that race lookups and appends."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from crest.drafters.recent import RecentDrafter, RecentIndex, RecentOptions, _hashes, _key_hash
from crest.errors import ConfigError

RNG = np.random.default_rng(7)


def _doc(n: int, vocab: int = 50_000) -> list[int]:
    return [int(t) for t in RNG.integers(0, vocab, n)]


def test_a_document_drafts_its_continuation_after_any_suffix_of_it() -> None:
    index = RecentIndex()
    doc = _doc(120)
    index.add(doc)
    for cut in (2, 5, 9, 40, 100):
        context = _doc(30) + doc[:cut]  # the suffix occurs once, `cut` tokens deep (capped by max_depth)
        tree = index.draft(context, 64)
        assert tree is not None, cut
        assert tree.n == min(cut, index.options.max_depth), cut
        want = doc[cut : cut + min(index.options.max_continuation, tree.n + 2)]
        assert tree.tokens.tolist() == want, cut  # a chain: one continuation
        assert tree.parents.tolist() == list(range(-1, len(want) - 1))
    assert index.draft(_doc(30), 64) is None  # nothing matches
    assert index.draft(doc[:5], 0) is None


def test_the_deepest_match_wins_over_more_recent_shallow_ones() -> None:
    index = RecentIndex()
    deep = _doc(60)
    index.add(deep)
    for _ in range(100):  # later documents that share only the last two tokens with the context
        index.add(_doc(10) + deep[28:30] + _doc(10))
    tree = index.draft(deep[:30], 16)
    assert tree is not None and tree.n == 30 and tree.tokens.tolist()[:16] == deep[30:46]


def test_equally_deep_matches_make_a_tree_weighted_by_count_most_recent_kept() -> None:
    index = RecentIndex(RecentOptions(matches=3))
    head = _doc(6)
    tails = [_doc(4) for _ in range(4)]
    for tail in tails:
        index.add(head + tail)
    index.add(head + tails[3])  # tails[3] twice, most recently
    tree = index.draft(head, 64)
    assert tree is not None and tree.n == 6
    firsts = {
        t: w
        for t, w, p in zip(tree.tokens.tolist(), tree.weights.tolist(), tree.parents.tolist(), strict=True)
        if p < 0
    }
    assert firsts == {tails[3][0]: 2, tails[2][0]: 1}  # the 3 most recent matches: tails 3, 3, 2


def test_matches_and_continuations_stop_at_document_boundaries() -> None:
    index = RecentIndex()
    a, b = _doc(10), _doc(10)
    index.add(a)
    index.add(b)
    tree = index.draft(a[-3:], 64)  # a's end: what follows in the buffer is b, another document
    assert tree is None
    assert index.draft(a[-2:] + b[:2], 64).n == 2  # type: ignore[union-attr]  # not 4: the join is no match


def test_the_continuation_grows_with_the_match_depth() -> None:
    index = RecentIndex(RecentOptions(max_continuation=32))
    doc = _doc(200)
    index.add(doc)
    lengths = [len(index.draft(doc[:cut], 64)) for cut in (2, 4, 8, 16, 40)]  # type: ignore[arg-type]
    assert lengths == [4, 6, 10, 18, 32]


def test_the_oldest_tokens_are_evicted_beyond_the_capacity() -> None:
    index = RecentIndex(RecentOptions(capacity=2048))
    first = _doc(500)
    index.add(first)
    for _ in range(10):
        index.add(_doc(500))
    index.compact()
    assert index.n_tokens <= 2048
    assert index.draft(first[:20], 8) is None  # evicted
    assert index.tokens_from(20, 8) == []  # a stream that followed it reads on no more
    last = _doc(300)
    index.add(last)
    assert index.draft(last[:20], 8).tokens.tolist() == last[20:28]  # type: ignore[union-attr]


def test_lookups_and_appends_during_folds_lose_nothing() -> None:
    index = RecentIndex(RecentOptions(capacity=1 << 22))
    docs = [_doc(64) for _ in range(3000)]
    errors: list[str] = []
    stop = threading.Event()

    def fold() -> None:
        while not stop.is_set():
            index.compact()

    folding = threading.Thread(target=fold)
    folding.start()
    try:
        for i, doc in enumerate(docs):
            index.add(doc)
            if i % 50 == 0:
                j = int(RNG.integers(0, i + 1))
                tree = index.draft(docs[j][:20], 8)
                if tree is None or tree.tokens.tolist() != docs[j][20:28]:
                    errors.append(f"doc {j} after {i}")
    finally:
        stop.set()
        folding.join()
    index.compact()
    assert not errors
    assert all(index.draft(d[:20], 8).tokens.tolist() == d[20:28] for d in docs[::97])  # type: ignore[union-attr]


def test_a_fold_started_with_empty_tails_is_still_the_only_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    import crest.drafters.recent as recent

    index = RecentIndex()
    first, second = _doc(64), _doc(64)
    index.add(first)
    index.compact()  # `first` in the sorted block; the tails empty
    entered, release = threading.Event(), threading.Event()

    class SlowSort:  # numpy, whose sort waits in the first fold's thread
        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        def argsort(self, a: np.ndarray, kind: str = "quicksort") -> np.ndarray:
            if threading.current_thread() is folder:
                entered.set()
                release.wait(10)
            return np.argsort(a, kind="stable" if kind == "stable" else "quicksort")

    monkeypatch.setattr(recent, "np", SlowSort())
    folder = threading.Thread(target=index.compact)  # folds empty tails, slowly
    folder.start()
    try:
        assert entered.wait(10)
        index.add(second)
        index.compact()  # a second fold meanwhile would be overwritten by the first one's older block
    finally:
        release.set()
        folder.join()
    for doc in (first, second):
        assert index.draft(doc[:20], 8).tokens.tolist() == doc[20:28]  # type: ignore[union-attr]
    index.compact()
    assert index.draft(second[:20], 8).tokens.tolist() == second[20:28]  # type: ignore[union-attr]


def test_a_fold_an_add_starts_runs_beside_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The add that fills a tail starts its fold on a thread of its own: the sort (tens of milliseconds at a
    million tokens) never lands on the step that learned a request, and appends and lookups go on meanwhile."""
    import crest.drafters.recent as recent

    main = threading.current_thread()
    entered, release = threading.Event(), threading.Event()

    class SlowSort:  # numpy, whose sort waits when a thread other than the caller's folds
        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        def argsort(self, a: np.ndarray, kind: str = "quicksort") -> np.ndarray:
            if threading.current_thread() is not main:
                entered.set()
                release.wait(30)
            return np.argsort(a, kind="stable" if kind == "stable" else "quicksort")

    monkeypatch.setattr(recent, "np", SlowSort())
    index = RecentIndex()
    docs = [_doc(300) for _ in range(240)]  # 72,000 tokens: past the 65,536 a tail holds before its fold
    try:
        for doc in docs:
            index.add(doc)
        assert entered.wait(30)  # a fold started, and waits in its sort
        later = _doc(300)
        index.add(later)
        for doc in (docs[0], docs[-1], later):
            assert index.draft(doc[:20], 8).tokens.tolist() == doc[20:28]  # type: ignore[union-attr]
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while index._folding and time.monotonic() < deadline:  # the fold's thread ends
        time.sleep(0.01)  # polling a condition under a deadline
    assert not index._folding
    for level in index._levels:  # folded: the tails hold only what came after the fold started
        assert level.sorted_h.shape[0] > 60_000 and len(level.tail) < 10_000
    for doc in (*docs[::40], later):
        assert index.draft(doc[:20], 8).tokens.tolist() == doc[20:28]  # type: ignore[union-attr]


def test_the_tails_hold_nothing_the_garbage_collector_tracks() -> None:
    """A tail of a list per hash made the cyclic collector walk tens of thousands of lists (tens of milliseconds
    in whichever step allocated); a tail's hash chains are ints."""
    import gc

    index = RecentIndex()
    for _ in range(20):
        index.add(_doc(300))
    for level in index._levels:
        assert len(level.tail) > 5000
        assert not gc.is_tracked(level.tail.last)  # a dict of ints only


def test_a_document_queued_with_add_soon_drafts_the_next_lookup() -> None:
    """`add_soon` returns at once and the writer thread adds the document; a lookup that comes first adds what is
    still queued, so every document drafts the very next lookup, whichever thread got there first."""
    index = RecentIndex()
    docs = [_doc(120) for _ in range(300)]
    for i, doc in enumerate(docs):
        index.add_soon(doc)
        if i % 3 == 0:  # now and then give the writer the lock first
            time.sleep(0)
        assert index.draft(doc[:20], 8).tokens.tolist() == doc[20:28], i  # type: ignore[union-attr]
    assert index.documents == len(docs)
    index.close()


def test_add_soon_adds_on_the_writer_thread_and_close_adds_what_is_left() -> None:
    index = RecentIndex()
    threads: list[threading.Thread] = []
    add = index.add

    def recording_add(tokens: list[int]) -> None:
        threads.append(threading.current_thread())
        add(tokens)

    index.add = recording_add  # type: ignore[method-assign,assignment]
    index.add_soon(_doc(64))
    deadline = time.monotonic() + 30
    while not threads and time.monotonic() < deadline:  # no lookup: only the writer adds it
        time.sleep(0.01)  # polling a condition under a deadline
    assert threads and threads[0] is not threading.current_thread()
    queued = [_doc(64) for _ in range(50)]
    for doc in queued:
        index.add_soon(doc)
    index.close()  # the writer stops; whatever it had not added yet is added here
    assert index.documents == 51
    late = _doc(64)
    index.add_soon(late)  # closed: added at once, on the caller's thread
    assert threads[-1] is threading.current_thread() and index.documents == 52


def test_the_drafter_names_its_part() -> None:
    index = RecentIndex()
    doc = _doc(20)
    index.add(doc)
    drafter = RecentDrafter(index)
    tree = drafter.draft(doc[:5], 8)
    assert drafter.drafted_parts(tree, context_length=5) == {"recent": tree}
    assert drafter.drafted_parts(None, context_length=5) == {}


@pytest.mark.parametrize(
    "options",
    [RecentOptions(keys=(4, 2)), RecentOptions(keys=(2, 80)), RecentOptions(capacity=10), RecentOptions(matches=0)],
    ids=["keys-out-of-order", "deep-key-past-depth", "tiny-capacity", "no-matches"],
)
def test_options_that_cannot_work_are_refused(options: RecentOptions) -> None:
    with pytest.raises(ConfigError, match="recent tier"):
        RecentIndex(options)


@pytest.mark.parametrize("k", [1, 2, 8, 16], ids=lambda k: f"k{k}")
def test_key_hash_is_the_index_hash(k: int) -> None:
    rng = np.random.default_rng(k)
    for _ in range(50):  # token ids up to a large vocabulary's: the products wrap modulo 2^64 many times
        tokens = rng.integers(0, 1 << 20, size=k + 5)
        assert _key_hash(tokens[-k:].tolist()) == int(_hashes(tokens, k)[-1])
