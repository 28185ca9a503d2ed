"""The SDK against a real PostgreSQL: longest-suffix lookup, cache, versions, fingerprints, corrupt rows, and
opening a store while the database is down (a closed port in front of the real server, opened later)."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client import (
    ConnectionUnavailable,
    CrestClientError,
    Draft,
    FingerprintMismatch,
    InvalidName,
    Store,
    StoreNotFound,
)
from crest_client.codec import encode_tree
from crest_client.keyfilter import KeyFilter

from crest import db
from crest.drafters.registry import close_drafter, open_drafter
from tests.fix_proxy import Proxy
from tests.fix_store import ROWS, VOCAB, chain_tree, draft_key, ngram_key, publish


@pytest.fixture()
def store(db_dsn: str) -> Iterator[Store]:
    publish(db_dsn, "demo", ROWS)
    handle = Store.connect(db_dsn, "demo", timeout=2.0)
    yield handle
    handle.close()


@pytest.mark.parametrize(
    ("context", "n", "first"),
    [
        ([1, 2, 3, 4, 5], 3, 300), ([7, 4, 5], 2, 200), ([8, 5], 1, 100), ([3, 9, 9], 2, 400), ([5], 1, 100),
        ([3, VOCAB + 9, 4, 5], 2, 200), ([3, 4, -1, 5], 1, 100),
    ],
    ids=["longest-3", "longest-2", "only-1", "other-2", "short-context", "oov-before-2", "negative-before-1"],
)  # fmt: skip
def test_draft_returns_longest_stored_suffix(store: Store, context: list[int], n: int, first: int) -> None:
    draft = store.draft(context)
    assert draft is not None
    assert draft.n == n
    assert int(draft.tokens[0]) == first
    (many,) = store.draft_many([context])
    assert many is not None and many.n == n and int(many.tokens[0]) == first


def test_filter_spares_round_trips_for_unstored_contexts(store: Store) -> None:
    assert store.info.key_filter is not None
    rng = np.random.default_rng(0)
    contexts = rng.integers(500, VOCAB, size=(300, 3)).tolist()  # no stored key has a token >= 500
    assert all(store.draft(ctx) is None for ctx in contexts)
    assert store.stats["queries"] < 0.1 * store.stats["lookups"]
    assert store.draft([8, 3, 4, 5]) is not None and store.stats["queries"] >= 1


def test_store_without_filter_probes_every_length(db_dsn: str) -> None:
    publish(db_dsn, "bare", ROWS, data=False)
    with Store.connect(db_dsn, "bare", timeout=2.0) as bare:
        assert bare.info.key_filter is None and bare.info.table is None
        draft = bare.draft([1, 3, 4, 5])
        assert draft is not None and draft.n == 3 and draft.tokens[0] == 300
        assert bare.draft([600, 700]) is None and bare.stats["queries"] == 2


def test_the_lookup_that_finds_a_new_version_reads_as_far_back_as_its_max_n(db_dsn: str) -> None:
    short = {k: tree for k, tree in ROWS.items() if len(k) <= 2}
    publish(db_dsn, "grows", short, max_n=2)
    with Store.connect(db_dsn, "grows", cache_size=0, refresh_interval=3600, timeout=2.0) as handle:
        (before,) = handle.draft_many([[3, 4, 5]])
        assert before is not None and before.n == 2 and handle.info.max_n == 2
        publish(db_dsn, "grows", ROWS, max_n=3)
        with psycopg.connect(db_dsn) as conn:
            assert db.clean_leftovers(conn, name="grows")  # the version the handle knew is dropped, as ingest does
        (after,) = handle.draft_many([[3, 4, 5]])  # this call finds the switch: its tail is max_n 3 long
        assert after is not None and after.n == 3 and int(after.tokens[0]) == 300


@pytest.mark.parametrize("context", [[1, 2, 6], [], [VOCAB + 5], [-1]], ids=["unknown", "empty", "oov", "negative"])
def test_draft_misses(store: Store, context: list[int]) -> None:
    assert store.draft(context) is None


def test_max_nodes_is_a_prefix_slice(store: Store) -> None:
    full = store.draft([3, 4, 5])
    cut = store.draft([3, 4, 5], max_nodes=3)
    assert full is not None and cut is not None
    assert cut.tokens.tolist() == full.tokens[:3].tolist()
    assert len(full) == 8


def test_cache_hits_and_can_be_disabled(db_dsn: str, store: Store) -> None:
    store.draft([3, 4, 5])
    store.draft([0, 3, 4, 5])  # same last max_n tokens
    assert store.stats["hits"] == 1
    with Store.connect(db_dsn, "demo", cache_size=0, timeout=2.0) as nocache:
        nocache.draft([3, 4, 5])
        nocache.draft([3, 4, 5])
        assert nocache.stats["hits"] == 0


def test_cache_is_bounded(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", cache_size=2, timeout=2.0) as handle:
        for ctx in ([5], [4, 5], [3, 4, 5], [9, 9]):
            handle.draft(ctx)
        assert len(handle._caches.tiers[0]) == 2 and len(handle._caches.keys[0]) <= 2


def test_draft_many_matches_draft(store: Store) -> None:
    contexts = [[1, 2, 3, 4, 5], [8, 5], [1, 2, 6], [3, 9, 9]]
    many = store.draft_many(contexts)
    store.clear_cache()
    one = [store.draft(c) for c in contexts]
    assert [d.tokens.tolist() if d else None for d in many] == [d.tokens.tolist() if d else None for d in one]


@pytest.mark.parametrize(
    ("load", "idle"), [(0.5, True), (2.0, False), (9.0, False), (None, False)], ids=["idle", "full", "over", "none"]
)
def test_lookups_poll_only_while_the_load_average_leaves_a_cpu_idle(
    monkeypatch: pytest.MonkeyPatch, load: float | None, idle: bool
) -> None:
    from crest_client import _connections

    def loadavg() -> tuple[float, float, float]:
        if load is None:
            raise OSError("no load average")
        return (load, load, load)

    monkeypatch.setattr(_connections, "_CPUS", 2)
    monkeypatch.setattr(_connections.os, "getloadavg", loadavg)
    monkeypatch.setattr(_connections, "_load_checked", -10.0)
    assert _connections.has_idle_cpu() is idle
    monkeypatch.setattr(_connections.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert _connections.has_idle_cpu() is idle  # read again a second later, not at every lookup


@pytest.mark.parametrize("idle", [True, False], ids=["cpu-idle-polls", "cpu-busy-sleeps"])
def test_busy_polling_for_the_answer_drafts_what_sleeping_does(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch, idle: bool
) -> None:
    from crest_client import _connections

    publish(db_dsn, "demo", ROWS)
    contexts = [[1, 2, 3, 4, 5], [8, 5], [3, 9, 9], [7, 4, 5], [5], [1, 2, 6]]
    with Store.connect(db_dsn, "demo", cache_size=0, timeout=2.0, spin=0.0) as asleep:
        want = [draft_key(d) for d in [*(asleep.draft(c) for c in contexts), *asleep.draft_many(contexts)]]
    asked: list[bool] = []

    def has_idle_cpu() -> bool:
        asked.append(idle)
        return idle

    monkeypatch.setattr(_connections, "has_idle_cpu", has_idle_cpu)
    with Store.connect(db_dsn, "demo", cache_size=0, timeout=2.0, spin=1.0) as polling:
        got = [draft_key(d) for d in [*(polling.draft(c) for c in contexts), *polling.draft_many(contexts)]]
        answered_polling = polling._conns.polled
    assert got == want
    assert len(asked) == polling.stats["queries"] > 0
    assert answered_polling == (polling.stats["queries"] if idle else 0)


@pytest.mark.parametrize(
    ("env", "given", "timeout", "spin"),
    [
        ({}, {}, 0.01, 0.0002),
        ({"CREST_LOOKUP_TIMEOUT": "0.75", "CREST_LOOKUP_SPIN": "0"}, {}, 0.75, 0.0),
        ({"CREST_LOOKUP_TIMEOUT": "0.75", "CREST_LOOKUP_SPIN": "0"}, {"timeout": 2.0, "spin": 0.001}, 2.0, 0.001),
    ],
    ids=["defaults", "environment", "arguments-win"],
)
def test_lookup_timeout_and_spin_come_from_the_environment_unless_given(
    db_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    given: dict[str, float],
    timeout: float,
    spin: float,
) -> None:
    publish(db_dsn, "demo", ROWS)
    for name in ("CREST_LOOKUP_TIMEOUT", "CREST_LOOKUP_SPIN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with Store.connect(db_dsn, "demo", cache_size=0, timeout=given.get("timeout"), spin=given.get("spin")) as handle:
        assert (handle._conns.timeout, handle._conns.spin) == (timeout, spin)
        with handle._conns.pool.connection() as conn:  # the server cancels a lookup at the same timeout
            shown = conn.execute("SELECT setting FROM pg_settings WHERE name = 'statement_timeout'").fetchone()
        assert shown is not None and shown[0] == str(round(timeout * 1000))  # milliseconds
        assert handle.draft([1, 2, 3, 4, 5]) is not None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CREST_LOOKUP_TIMEOUT", "0"),
        ("CREST_LOOKUP_TIMEOUT", "ten"),
        ("CREST_LOOKUP_SPIN", "-1"),
        ("CREST_LOOKUP_SPIN", "nan"),
    ],
    ids=["zero-timeout", "word", "negative-spin", "nan"],
)
def test_a_bad_lookup_timing_variable_is_a_clear_error(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    publish(db_dsn, "demo", ROWS)
    monkeypatch.setenv(name, value)
    with pytest.raises(CrestClientError, match=f"{name} must be a number of seconds"):
        Store.connect(db_dsn, "demo")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        pytest.param({"timeout": 0}, "timeout must be a number of seconds > 0", id="zero-timeout"),
        pytest.param({"timeout": -1.0}, "timeout must be a number of seconds > 0", id="negative-timeout"),
        pytest.param({"timeout": math.inf}, "timeout must be .* at most", id="infinite-timeout"),
        pytest.param({"timeout": math.nan}, "timeout must be a number", id="nan-timeout"),
        pytest.param({"timeout": 1e12}, "timeout must be .* at most 2147483.647", id="past-postgres-timeout"),
        pytest.param({"spin": -0.1}, "spin must be a number of seconds >= 0", id="negative-spin"),
        pytest.param({"refresh_interval": math.nan}, "refresh_interval must be", id="nan-refresh"),
        pytest.param({"connect_timeout": 0}, "connect_timeout must be a number of seconds > 0", id="zero-connect"),
        pytest.param({"cache_size": -1}, "cache_size must be a whole number >= 0", id="negative-cache"),
        pytest.param({"pool_size": 0}, "pool_size must be a whole number >= 1", id="empty-pool"),
        pytest.param({"pool_size": 2.5}, "pool_size must be a whole number", id="fractional-pool"),
    ],
)
def test_a_bad_connect_argument_is_a_clear_error(db_dsn: str, given: dict[str, Any], message: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with pytest.raises(CrestClientError, match=message):
        Store.connect(db_dsn, "demo", **given)


def test_connect_takes_numpy_counts_and_a_refresh_interval_of_never(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=math.inf) as never:
        assert never.draft([3, 4, 5]) is not None
    sizes: dict[str, Any] = {"cache_size": np.int64(8), "pool_size": np.int32(1)}  # counts from numpy arithmetic
    with Store.connect(db_dsn, "demo", timeout=2.0, **sizes) as handle:
        assert handle.draft([3, 4, 5]) is not None


@pytest.mark.parametrize("live", [False, True], ids=["static-only", "with-live-tier"])
def test_max_nodes_below_one_is_no_draft_and_a_fraction_is_refused(db_dsn: str, live: bool) -> None:
    publish(db_dsn, "sized", ROWS)
    if live:
        publish(db_dsn, "sized", {(4, 5): chain_tree(600, 3)}, tier="live")
    with Store.connect(db_dsn, "sized", timeout=2.0) as handle:
        assert (handle.live is not None) == live
        for nodes in (0, -3):
            assert handle.draft([3, 4, 5], max_nodes=nodes) is None
            assert handle.draft_many([[3, 4, 5], [5]], max_nodes=nodes) == [None, None]
            assert handle.draft_parts([3, 4, 5], max_nodes=nodes) == [None, None]
        for bad in (2.5, "8", True):
            with pytest.raises(CrestClientError, match="max_nodes must be a whole number"):
                handle.draft([3, 4, 5], max_nodes=bad)  # type: ignore[arg-type]
        counted: Any = np.int64(1)  # a count from numpy arithmetic
        one = handle.draft([3, 4, 5], max_nodes=counted)
        assert one is not None and len(one) == 1


def test_a_hung_database_costs_each_draft_one_wait_not_two(db_dsn: str) -> None:
    publish(db_dsn, "hangs", ROWS)
    proxy, proxied = Proxy.fronting(db_dsn)
    proxy.up()
    try:
        with Store.connect(proxied, "hangs", cache_size=0, refresh_interval=0, timeout=0.3, pool_size=1) as handle:
            assert handle.draft([3, 4, 5]) is not None
            proxy.stall()  # every call checks the version first (refresh_interval 0), and the check waits in vain
            assert [handle.draft([3, 4, 5]) for _ in range(3)] == [None, None, None]
            assert handle.stats["timeouts"] + handle.stats["errors"] == 3  # the lookup after it was not sent
            proxy.resume()
            deadline = time.monotonic() + 30
            while handle.draft([3, 4, 5]) is None:  # the pool reconnects once the database answers again
                assert time.monotonic() < deadline, handle.stats
    finally:
        proxy.resume()
        proxy.down()


def _session(handle: Store) -> int:
    """Return the server process of the connection the handle's last lookup ran on (it keeps it for the next)."""
    return int(handle._conns._idle[-1].info.backend_pid)


def _draft_in_child(handle: Store, context: list[int], want: Draft, parent_session: int) -> int:
    """In a forked child: draft until the store answers, on a session of the child's own; close the handle."""
    deadline = time.monotonic() + 60
    got = handle.draft(context)
    while got is None and time.monotonic() < deadline:  # the child's pool opens at its first lookup
        got = handle.draft(context)
    if got is None or got.tokens.tolist() != want.tokens.tolist():
        return 1
    if _session(handle) == parent_session:
        return 2  # the child read on the parent's session
    handle.close()  # as a `with` block ends: it must not end the parent's session
    return 0


def test_a_store_used_after_fork_reads_on_its_own_connections_and_leaves_the_parents(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    context = [3, 4, 5]
    with Store.connect(db_dsn, "demo", cache_size=0, timeout=2.0, refresh_interval=math.inf, pool_size=1) as handle:
        want = handle.draft(context)
        assert want is not None
        session = _session(handle)
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 3
            try:
                code = _draft_in_child(handle, context, want, session)
            finally:
                os._exit(code)
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish")
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(done[1]) == 0, "1: no draft, 2: the parent's session, 3: it raised"
        again = handle.draft(context)  # the parent's session is whole: the same connection answers
        assert again is not None and again.tokens.tolist() == want.tokens.tolist()
        assert _session(handle) == session and handle.stats["errors"] == handle.stats["timeouts"] == 0, handle.stats


def _learn_and_follow_in_child(handle: Store, learned: Any, published: Any) -> None:
    """In a forked child: learn a row, then draft until the version published after the fork answers; exit 0.

    The handle is neither flushed nor closed: a multiprocessing child writes what it learned as it ends.
    """
    handle.learn([41, 42, 43], prompt_tokens=1)
    learned.set()
    if not published.wait(60):
        raise SystemExit(4)
    deadline = time.monotonic() + 60
    while (draft := handle.draft([7, 8, 5])) is None or int(draft.tokens[0]) != 500:
        if time.monotonic() > deadline:
            raise SystemExit(5)
        time.sleep(0.01)


def test_a_store_used_after_fork_learns_and_follows_new_versions_in_the_child(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    fork = multiprocessing.get_context("fork")
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=0.0) as handle:
        draft = handle.draft([7, 8, 5])
        assert draft is not None and int(draft.tokens[0]) == 100
        handle.learn([1, 2, 3])  # the parent's learner and its writer thread run before the fork
        learned, published = fork.Event(), fork.Event()
        child = fork.Process(target=_learn_and_follow_in_child, args=(handle, learned, published))
        with handle._lock, handle._learner._cond:  # as another thread's lookup and learn() may hold them at the fork
            child.start()
        try:
            assert learned.wait(60), "the child never learned"
            publish(db_dsn, "demo", {(8, 5): chain_tree(500, 3)})  # a version the child's loader must read
            published.set()
            child.join(90)
        finally:
            if child.exitcode is None:  # hung (a lock the parent held at the fork)
                child.kill()
                child.join()
        assert child.exitcode == 0, "4: never told of the version, 5: it never followed it, -9: it hung"
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # the parent's row by the parent, the child's by the child
        rows = conn.execute("SELECT tokens FROM crest_learned WHERE store = 'demo' ORDER BY tokens").fetchall()
    assert [np.frombuffer(t, "<u4").tolist() for (t,) in rows] == [[1, 2, 3], [41, 42, 43]]


LIVE = {(4, 5): chain_tree(600, 3), (7, 7, 7): chain_tree(700, 5)}


def _firsts(parts: list[list[Draft | None]]) -> list[list[int | None]]:
    return [[int(d.tokens[0]) if d is not None else None for d in row] for row in parts]


@pytest.mark.parametrize("batch", [False, True], ids=["draft", "draft_many"])
def test_expected_rule_prefers_a_rich_shorter_suffix_over_a_thin_longer_one(db_dsn: str, batch: bool) -> None:
    thin = chain_tree(900, 3)  # weights 3, 2, 1 from 7 occurrences: 3 / 8 that its first token is right
    rich = encode_tree(np.array([50, 51]), np.array([-1, 0], dtype=np.int32), np.array([7, 7]), vocab_size=VOCAB)
    publish(db_dsn, "demo", {(4, 5): rich, (3, 4, 5): thin})
    for rule, first in (("longest", 900), ("expected", 50)):
        with Store.connect(db_dsn, "demo", timeout=2.0, rule=rule) as handle:
            draft = handle.draft_many([[3, 4, 5]])[0] if batch else handle.draft([3, 4, 5])
            assert draft is not None and int(draft.tokens[0]) == first, rule


@pytest.mark.parametrize("batch", [False, True], ids=["draft", "draft_many"])
def test_the_live_tier_drafts_from_its_longest_suffix_whatever_the_rule(db_dsn: str, batch: bool) -> None:
    thin = chain_tree(900, 3)  # what was served lately: a few occurrences of the exact context
    rich = encode_tree(np.array([50, 51]), np.array([-1, 0], dtype=np.int32), np.array([7, 7]), vocab_size=VOCAB)
    publish(db_dsn, "demo", {(4, 5): rich, (3, 4, 5): thin})
    publish(db_dsn, "demo", {(4, 5): rich, (3, 4, 5): thin}, tier="live")
    with Store.connect(db_dsn, "demo", timeout=2.0, rule="expected") as handle:
        parts = handle.draft_many_parts([[3, 4, 5]])[0] if batch else handle.draft_parts([3, 4, 5])
        static, live = parts
        assert static is not None and live is not None
        assert (int(static.tokens[0]), int(live.tokens[0])) == (50, 900)  # static: the rule; live: the longest


def test_unknown_suffix_rule_is_a_clear_error(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    publish(db_dsn, "demo", ROWS)
    monkeypatch.setenv("CREST_SUFFIX_RULE", "shortest")
    with pytest.raises(CrestClientError, match="unknown suffix rule 'shortest'"):
        Store.connect(db_dsn, "demo", timeout=2.0)


def test_draft_parts_returns_static_and_live_in_one_statement(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    publish(db_dsn, "demo", LIVE, tier="live")
    with Store.connect(db_dsn, "demo", timeout=2.0) as handle:
        assert handle.live is not None and handle.live.tier == "live"
        before = handle.stats["queries"]
        parts = handle.draft_many_parts([[1, 2, 3, 4, 5], [7, 7, 7], [8, 8], [9, 9]])
        assert handle.stats["queries"] == before + 1
        assert _firsts(parts) == [[300, 600], [None, 700], [None, None], [400, None]]
        assert _firsts([handle.draft_parts([3, 4, 5])]) == [[300, 600]]  # cached: no statement
        assert handle.stats["queries"] == before + 1
        static = handle.draft([3, 4, 5], tier="static")
        assert static is not None and int(static.tokens[0]) == 300
        live = handle.draft([3, 4, 5], tier="live")
        assert live is not None and int(live.tokens[0]) == 600
        both = handle.draft([3, 4, 5])  # the default: every published tier's tree, merged
        assert both is not None and {300, 600} <= set(both.tokens.tolist())
        many = handle.draft_many([[3, 4, 5]])[0]
        assert many is not None and many.tokens.tolist() == both.tokens.tolist()
        assert handle.stats["queries"] == before + 1  # all from the cache
        with pytest.raises(CrestClientError, match="unknown tier 'warm'"):
            handle.draft([3, 4, 5], tier="warm")


def test_draft_parts_follows_a_live_tier_published_later(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with (
        Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=0.0) as handle,
        Store.connect(db_dsn, "demo", timeout=2.0, live=False, refresh_interval=0.0) as static_only,
    ):
        assert handle.live is None
        assert _firsts([handle.draft_parts([7, 7, 7])]) == [[None, None]]
        publish(db_dsn, "demo", LIVE, tier="live")
        assert _firsts([handle.draft_parts([7, 7, 7])]) == [[None, 700]]
        assert _firsts([static_only.draft_parts([7, 7, 7])]) == [[None, None]]
        publish(db_dsn, "demo", {(7, 7, 7): chain_tree(800, 2)}, tier="live")
        assert _firsts([handle.draft_parts([7, 7, 7])]) == [[None, 800]]


def test_a_new_version_is_read_off_the_lookup_path(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import crest_client.store as sdk_store

    publish(db_dsn, "demo", ROWS)
    release, reading = threading.Event(), threading.Event()
    real = sdk_store.read_live

    def slow_read_live(*args: Any, **kw: Any) -> Any:  # a large live version whose token table takes long to read
        reading.set()
        assert release.wait(60)
        return real(*args, **kw)

    with Store.connect(db_dsn, "demo", timeout=0.05, refresh_interval=0.0) as handle:
        assert handle.live is None
        monkeypatch.setattr(sdk_store, "read_live", slow_read_live)
        publish(db_dsn, "demo", LIVE, tier="live")
        answered: list[Any] = []
        caller = threading.Thread(target=lambda: answered.append(handle.draft_parts([1, 2, 3, 4, 5])))
        caller.start()
        caller.join(30)  # a synchronous read would hold this lookup until `release`
        assert not caller.is_alive() and reading.is_set(), "the lookup waited for the new version's read"
        assert _firsts(answered) == [[300, None]]  # the version it knew answered
        release.set()
        deadline = time.monotonic() + 60
        while _firsts([handle.draft_parts([7, 7, 7])]) != [[None, 700]]:  # once read, the next lookups follow it
            assert time.monotonic() < deadline, "the new live version was never followed"
            time.sleep(0.01)


def test_a_single_lookup_is_a_batch_of_one_on_a_shared_handle(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    publish(db_dsn, "demo", LIVE, tier="live")
    first, then = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 600, 3, 4, 5]  # the live tier proved right after `first`
    with Store.connect(db_dsn, "demo", timeout=2.0) as handle:
        assert handle.live is not None
        assert handle.draft(first, 8) is not None  # both tiers draft here
        many = handle.draft_many([then], 8)[0]  # another thread's batch, between this sequence's calls
        one = handle.draft(then, 8)  # a handle that learned scales from `first` merged `then` unequally
        assert one is not None and many is not None
        assert one.tokens.tolist() == many.tokens.tolist() and one.weights.tolist() == many.weights.tolist()
        assert handle.draft(then, 8).weights.tolist() == one.weights.tolist()  # type: ignore[union-attr]


def test_store_drafter_merges_static_and_live_trees(db_dsn: str) -> None:
    from crest.drafters.store import StoreDrafter

    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=0.0) as handle:
        drafter = StoreDrafter(handle)
        assert drafter.draft([7, 7, 7], 8) is None
        static = drafter.draft([1, 2, 3, 4, 5], 16)
        assert static is not None and static.tokens.tolist() == list(range(300, 308))
        publish(db_dsn, "demo", LIVE, tier="live")
        live_only = drafter.draft([7, 7, 7], 8)
        assert live_only is not None and live_only.tokens.tolist() == list(range(700, 705))
        both = drafter.draft([1, 2, 3, 4, 5], 16)
        assert both is not None and {300, 600} <= set(both.tokens.tolist())  # one tree holding both tiers' paths
        assert drafter.draft([1, 2, 3, 4, 5], 0) is None


def test_live_tier_of_another_tokenizer_is_ignored(db_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    publish(db_dsn, "demo", ROWS)
    publish(db_dsn, "demo", LIVE, tier="live", fingerprint="fp-b")
    with caplog.at_level(logging.WARNING), Store.connect(db_dsn, "demo", timeout=2.0) as handle:
        assert handle.live is None
        assert _firsts([handle.draft_parts([7, 7, 7])]) == [[None, None]]
    assert "another tokenizer" in caplog.text


def test_wrong_fingerprint_is_a_clear_error(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with pytest.raises(FingerprintMismatch, match="another tokenizer"):
        Store.connect(db_dsn, "demo", tokenizer_fingerprint="fp-other")


def test_a_store_left_open_warns_and_a_closed_one_does_not(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Store.connect(db_dsn, "demo", timeout=2.0).close()
        with Store.connect(db_dsn, "demo", timeout=2.0) as handle:
            assert handle.draft([3, 4, 5]) is not None
        with pytest.raises(StoreNotFound):
            Store.connect(db_dsn, "nope")  # a failed connect closes the pool it opened
        del handle
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    leaked = Store.connect(db_dsn, "demo", timeout=2.0)
    pool = leaked._conns.pool
    try:
        with pytest.warns(ResourceWarning, match="crest store 'demo' was never closed"):
            del leaked
            gc.collect()
    finally:
        pool.close()


def test_the_suite_fails_on_a_leaked_store_or_connection() -> None:
    """pyproject's filterwarnings: a ResourceWarning, and one raised in __del__ (unraisable), fail the test."""
    with pytest.raises(ResourceWarning):
        warnings.warn("a connection left open", ResourceWarning, stacklevel=1)
    with pytest.raises(pytest.PytestUnraisableExceptionWarning):  # how pytest reports a warning raised in __del__
        warnings.warn(pytest.PytestUnraisableExceptionWarning("Exception ignored in: <Store>"), stacklevel=1)


def test_unknown_store_and_bad_name(db_dsn: str) -> None:
    with pytest.raises(StoreNotFound, match="nope"):
        Store.connect(db_dsn, "nope")
    with pytest.raises(InvalidName):
        Store.connect(db_dsn, "x; DROP TABLE crest_stores")


@pytest.mark.parametrize("how", ["refresh-interval", "old-version-dropped"])
def test_reader_follows_a_republished_version(db_dsn: str, how: str) -> None:
    publish(db_dsn, "demo", ROWS)
    interval = 0.0 if how == "refresh-interval" else 3600.0
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=interval) as store:
        assert store.draft([8, 5]) is not None
        publish(db_dsn, "demo", {(8, 5): chain_tree(500, 3)})
        if how == "old-version-dropped":
            with db.session(db_dsn) as conn:
                db.clean_leftovers(conn)
        draft = store.draft([7, 8, 5])  # a cache miss, served by the new version
        assert draft is not None and int(draft.tokens[0]) == 500
        assert store.draft([3, 4, 5]) is None  # the old version's cached entries were dropped


def test_reader_stays_on_its_version_until_refresh(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=3600.0) as store:
        publish(db_dsn, "demo", {(8, 5): chain_tree(500, 3)})
        draft = store.draft([7, 8, 5])
        assert draft is not None and int(draft.tokens[0]) == 100  # still the complete old version


def test_republish_leaves_one_published_version_and_drops_old_tables(db_dsn: str) -> None:
    first = publish(db_dsn, "demo", ROWS)
    second = publish(db_dsn, "demo", ROWS)
    with db.session(db_dsn) as conn:
        db.clean_leftovers(conn)
        states = conn.execute("SELECT id, state FROM crest_stores ORDER BY id").fetchall()
        tables = conn.execute(
            "SELECT to_regclass(%s), to_regclass(%s)", (f"crest_ngrams_s{first}", f"crest_ngrams_s{second}")
        ).fetchone()
    assert states == [(second, "published")]
    assert tables is not None and tables[0] is None and tables[1] is not None


ALTERATIONS = {  # SQL expressions of the stored blob `tree`, each a damage the decoder must notice
    "garbage": "'\\x0102030405'::bytea",
    "empty": "''::bytea",
    "truncated": "substring(tree from 1 for length(tree) - 1)",
    "cut-in-half": "substring(tree from 1 for length(tree) / 2)",
    "extended": "tree || '\\x00'::bytea",
    "unknown-version": "set_byte(tree, 0, 99)",
}


@pytest.mark.parametrize("alteration", list(ALTERATIONS), ids=list(ALTERATIONS))
def test_tree_altered_in_the_database_is_a_miss_logged_once(
    db_dsn: str, caplog: pytest.LogCaptureFixture, alteration: str
) -> None:
    publish(db_dsn, "demo", ROWS)
    store = Store.connect(db_dsn, "demo", timeout=2.0, rule="longest")  # the longest suffix drafts, corrupt or not
    assert store.draft([3, 4, 5]) is not None
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE crest_ngrams SET tree = {ALTERATIONS[alteration]} WHERE n = 3")
        conn.execute(
            "UPDATE crest_ngrams SET tree = '\\x0102030405'::bytea WHERE n = 2 AND key = %s", (ngram_key((9, 9)),)
        )
    store.clear_cache()
    for _ in range(2):
        assert store.draft([3, 4, 5]) is None  # the longest suffix's tree is corrupt: a miss, no fallback
        assert store.draft([3, 9, 9]) is None
        store.clear_cache()
    assert store.draft_many([[3, 4, 5], [3, 9, 9]]) == [None, None]
    assert sum("corrupt tree" in r.message for r in caplog.records) == 1
    assert store.stats["errors"] >= 5
    draft = store.draft([8, 5])  # intact rows still draft
    assert draft is not None and int(draft.tokens[0]) == 100
    store.close()


def test_tree_with_a_token_outside_the_vocabulary_is_a_miss(
    db_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    wide = encode_tree(np.array([7, VOCAB + 3]), np.array([-1, 0]), np.array([7, 1]), vocab_size=VOCAB * 100)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE crest_ngrams SET tree = %s WHERE n = 3", (wide,))
    assert store.draft([3, 4, 5]) is None  # well formed, but no model of this store has that token
    assert sum("outside the store's vocabulary" in r.message for r in caplog.records) == 1
    assert store.draft([8, 5]) is not None


def test_killed_build_is_cleaned_and_previous_version_kept(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    build = db.begin_build(
        db_dsn, "demo", fingerprint="fp-a", tokenizer="t", vocab_size=VOCAB, token_width=2, params={}
    )
    build.copy_ngrams([(ngram_key((1,)), 1, 1, chain_tree(1, 2))])
    build.conn.close()  # the builder dies: its liveness lock goes with its session
    with Store.connect(db_dsn, "demo", timeout=2.0) as handle:
        assert handle.draft([3, 4, 5]) is not None
    with db.session(db_dsn) as conn:
        removed = db.clean_leftovers(conn)
        left = conn.execute("SELECT count(*) FROM crest_stores").fetchone()
    assert removed == [build.store_id]
    assert left == (1,)


def test_live_build_is_not_cleaned(db_dsn: str) -> None:
    build = db.begin_build(
        db_dsn, "demo", fingerprint="fp-a", tokenizer="t", vocab_size=VOCAB, token_width=2, params={}
    )
    try:
        with db.session(db_dsn) as conn:
            assert db.clean_leftovers(conn) == []
    finally:
        build.close()


def test_store_is_safe_to_share_between_threads(db_dsn: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=5.0, pool_size=3, cache_size=2) as store:
        contexts = [[1, 2, 3, 4, 5], [8, 5], [3, 9, 9], [1, 2, 6]] * 50
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda c: store.draft(c), contexts))
        firsts = [int(d.tokens[0]) if d is not None else None for d in results]
        assert firsts == [300, 100, 400, None] * 50
        assert store.stats["errors"] == 0


def test_connect_reads_large_store_data_beyond_the_lookup_timeout(db_dsn: str) -> None:
    sid = publish(db_dsn, "demo", ROWS)
    rng = np.random.default_rng(0)
    big = KeyFilter.build(rng.integers(0, 2**63, size=4_000_000, dtype=np.uint64))  # ~5 MB, like a large store's
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE crest_store_data SET key_filter = %s WHERE store_id = %s", (big.to_bytes(), sid))
    # a 1 ms lookup timeout must not apply to reading the version's data once
    with Store.connect(db_dsn, "demo", timeout=0.001) as store:
        assert store.info.key_filter is not None and len(store.info.key_filter) == len(big)


def test_connect_waits_for_a_locked_catalog_beyond_the_lookup_timeout(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    done: list[Any] = []

    def connect() -> None:
        try:
            with Store.connect(db_dsn, "demo", timeout=0.001, connect_timeout=30.0) as store:
                done.append(store.info.id)
        except Exception as exc:  # handed to the test thread
            done.append(exc)

    with psycopg.connect(db_dsn) as locker:  # the catalog locked: connect's first read waits
        locker.execute("LOCK TABLE crest_stores IN ACCESS EXCLUSIVE MODE")
        worker = threading.Thread(target=connect, daemon=True)
        worker.start()
        deadline = time.monotonic() + 30
        with psycopg.connect(db_dsn, autocommit=True) as watcher:
            while not done and time.monotonic() < deadline:  # until the client's read waits on the lock
                waiting = watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'crest-client'"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()
                if waiting != (0,):
                    break
        locker.rollback()
    worker.join(30)
    assert done and isinstance(done[0], int), done  # read within connect_timeout, not the 1 ms lookup timeout


@pytest.mark.parametrize("pool_size", [1, 2], ids=["one", "two"])
def test_a_lookup_past_its_timeout_cancels_its_statement_and_keeps_the_connection(db_dsn: str, pool_size: int) -> None:
    sid = publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=0.3, pool_size=pool_size, cache_size=0) as store:
        assert draft_key(store.draft([1, 2, 3, 4, 5]))  # a kept connection with the statement prepared
        for kept in store._conns._idle:  # only the client's clock ends the wait (as when the server's answer is late)
            kept.execute("SET statement_timeout = 0")
        opened = store._conns.pool.get_stats()["connections_num"]
        with psycopg.connect(db_dsn) as locker:  # holds the lock until its transaction ends
            locker.execute(f"LOCK TABLE crest_ngrams_s{sid} IN ACCESS EXCLUSIVE MODE")
            assert store.draft([1, 2, 3, 4, 5]) is None  # blocked past the timeout: no draft, no error raised
            assert store.stats["timeouts"] == 1 and store.stats["errors"] == 0
        assert draft_key(store.draft([1, 2, 3, 4, 5]))  # the lock gone: the same connection drafts again
        assert store._conns.pool.get_stats()["connections_num"] == opened  # cancelled, not closed and reopened
        with psycopg.connect(db_dsn, autocommit=True) as conn:  # the cancelled statement left no backend busy
            busy = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'crest-client' AND state = 'active'"
            ).fetchone()
        assert busy == (0,)


# --- a database that is down when a store is opened -----------------------------------------------------------


class Gate:
    """A TCP port in front of the real test server: refuses connections until opened, then forwards them."""

    def __init__(self, upstream: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(upstream)
        host, port = str(info.get("host") or "/tmp"), int(info.get("port") or 5432)
        self.upstream: Any = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))  # bound but not listening: a connection is refused at once
        info |= {"host": "127.0.0.1", "port": self.listener.getsockname()[1]}
        self.dsn = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
        self.sockets: list[socket.socket] = []

    def open(self) -> None:
        """Accept connections from now on and forward each one to the server."""
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Cut every forwarded connection and refuse new ones."""
        for sock in (self.listener, *self.sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            family = socket.AF_UNIX if isinstance(self.upstream, str) else socket.AF_INET
            server = socket.socket(family)
            server.connect(self.upstream)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()


@pytest.fixture()
def gate(db_dsn: str) -> Iterator[Gate]:
    """A closed door to a database holding the published store `demo`."""
    publish(db_dsn, "demo", ROWS)
    door = Gate(db_dsn)
    yield door
    door.close()


def connect_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the thread of every connection attempt from now on (the SDK's plain ones and its pools')."""
    threads: list[str] = []
    plain, pooled = psycopg.connect, psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def attempt(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return plain(*args, **kw)

    def pool_attempt(cls: Any, *args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return pooled(cls, *args, **kw)

    monkeypatch.setattr(psycopg, "connect", attempt)
    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(pool_attempt))
    return threads


def test_connect_to_a_down_database_fails_at_once_with_the_reason(
    gate: Gate, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crest_client import _connections

    attempts = connect_attempts(monkeypatch)
    monkeypatch.setattr(_connections, "new_pool", lambda *a, **kw: pytest.fail("a pool (waits and retries) opened"))
    with pytest.raises(ConnectionUnavailable, match="refused") as failure:
        Store.connect(gate.dsn, "demo", connect_timeout=10.0)
    # what it promises, not the machine's speed: one plain attempt, refused, and no pool that would wait and retry
    # for the connect timeout
    assert len(attempts) == 1, attempts
    assert "\n" not in str(failure.value)
    assert not [r for r in caplog.records if r.name.startswith("psycopg")], "the pool's retry lines got out"


@pytest.mark.parametrize("name", ["crest", "crest+prompt"])
def test_store_drafter_opened_while_the_database_is_down_drafts_once_it_is_back(
    gate: Gate,
    db_dsn: str,
    name: str,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with Store.connect(db_dsn, "demo", timeout=2.0) as direct:
        want = direct.draft([3, 4, 5], max_nodes=8)
    assert want is not None
    caplog.set_level(logging.INFO)
    attempts, here = connect_attempts(monkeypatch), threading.current_thread().name
    drafter = open_drafter(name, store="demo", dsn=gate.dsn, fingerprint="fp-a", retry_interval=0.05)
    request.addfinalizer(lambda: close_drafter(drafter))
    assert attempts == [here], "opening with the database down tried more than once, or waited for a pool"
    deadline, steps = time.monotonic() + 60, 0
    while steps < 20 or len(attempts) < 3:  # steps go on while it retries (every 0.05 s) in the background
        assert drafter.draft([3, 4, 5], 8) is None
        steps += 1
        assert time.monotonic() < deadline, "the drafter never retried in the background"
        time.sleep(0.01)
    assert here not in attempts[1:], attempts  # a step never waits for the database: it never connects itself
    gate.open()
    deadline = time.monotonic() + 20.0
    got = None
    while got is None and time.monotonic() < deadline:
        got = drafter.draft([3, 4, 5], 8)
        time.sleep(0.02)
    assert got is not None, "the drafter did not use the store once the database was back"
    assert set(want.tokens.tolist()) <= set(got.tokens.tolist())
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert not [r for r in caplog.records if r.name.startswith("psycopg")], "the pool's retry lines got out"


@pytest.mark.parametrize(
    ("store", "fingerprint", "error"),
    [("nope", "fp-a", StoreNotFound), ("demo", "fp-other", FingerprintMismatch)],
    ids=["missing-store", "other-tokenizer"],
)
def test_store_drafter_refuses_a_wrong_store_when_the_database_answers(
    db_dsn: str, store: str, fingerprint: str, error: type[Exception]
) -> None:
    publish(db_dsn, "demo", ROWS)
    with pytest.raises(error):
        open_drafter("crest", store=store, dsn=db_dsn, fingerprint=fingerprint)


def test_a_database_lost_mid_run_is_one_warning_line_and_no_pool_lines(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    gate.open()
    with Store.connect(gate.dsn, "demo", cache_size=0, timeout=0.5) as handle:
        assert handle.draft([3, 4, 5]) is not None
        gate.close()  # every connection cut, new ones refused
        assert all(handle.draft([3, 4, 5]) is None for _ in range(5))
        assert handle.stats["errors"] > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert not [r for r in caplog.records if r.name.startswith("psycopg")], "the pool's lines got out"


def test_store_learn_appends_in_the_background_and_close_writes_the_queue(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    handle = Store.connect(db_dsn, "demo", timeout=2.0)
    handle.learn([1, 2, 3, 4, 5, 6], prompt_tokens=2)
    handle.learn(np.array([7, 8, 9]))
    handle.close()  # writes what was queued
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tokens, n_tokens, prompt_tokens, source FROM crest_learned WHERE store = 'demo' ORDER BY id"
        ).fetchall()
    assert [(np.frombuffer(t, "<u4").tolist(), n, p, s) for t, n, p, s in rows] == [
        ([1, 2, 3, 4, 5, 6], 6, 2, "sdk"),
        ([7, 8, 9], 3, 0, "sdk"),
    ]
