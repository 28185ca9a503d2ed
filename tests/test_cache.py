"""The SDK's caches (crest_client._cache) against a real PostgreSQL: a context never seen is answered by key when
its suffixes were looked up before, always as the database would answer it. The fixture's versions record no
ingest-time rule, so these stores read them with the `longest` rule (an ingested store records its own)."""

from __future__ import annotations

import random

import pytest
from crest_client import Draft, Store

from tests.fix_store import ROWS, chain_tree, publish

LIVE = {(4, 5): chain_tree(600, 3), (7, 7, 7): chain_tree(700, 5), (1,): chain_tree(800, 2)}


def _seen(parts: list[Draft | None]) -> list[tuple[int, list[int]] | None]:
    return [(d.n, d.tokens.tolist()) if d is not None else None for d in parts]


def test_a_new_context_whose_longest_suffix_was_looked_up_takes_no_statement(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=3600.0, rule="longest") as store:
        first = store.draft([1, 4, 5])  # (1, 4, 5) is not stored: (4, 5) is its longest stored suffix
        assert first is not None and first.n == 2
        queries = store.stats["queries"]
        again = store.draft([2, 4, 5])  # another tail, the same longest stored suffix: known by key
        assert again is not None and again.tokens.tolist() == first.tokens.tolist() and again.n == 2
        assert store.stats["queries"] == queries
        longer = store.draft([3, 4, 5])  # a longer suffix may be stored, and is: the database answers it
        assert longer is not None and longer.n == 3 and store.stats["queries"] == queries + 1
        assert store.draft([6, 6]) is None and store.stats["queries"] == queries + 1  # the filter rules (6,) out


@pytest.mark.parametrize("rule", ["longest", "expected"])
def test_key_cached_answers_equal_the_databases_on_many_contexts(db_dsn: str, rule: str) -> None:
    """Random contexts over the stored tokens, through a cached store and an uncached one, both tiers: every answer
    is the same, and with the `longest` rule the cached store sends far fewer statements (the `expected` rule
    weighs every stored suffix: only whole tails are cached)."""
    publish(db_dsn, "demo", ROWS)
    publish(db_dsn, "demo", LIVE, tier="live")
    pick = random.Random(7)
    contexts = [[pick.choice([1, 2, 3, 4, 5, 7, 8, 9]) for _ in range(pick.randint(1, 5))] for _ in range(400)]
    with (
        Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=3600.0, cache_size=64, rule=rule) as cached,
        Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=3600.0, cache_size=0, rule=rule) as plain,
    ):
        for start in range(0, len(contexts), 4):  # batches, as a proposer's step sends them
            batch = contexts[start : start + 4]
            got, want = cached.draft_many_parts(batch), plain.draft_many_parts(batch)
            assert [_seen(p) for p in got] == [_seen(p) for p in want], batch
        static, live = cached._caches.keys
        assert (len(static) > 0) == (rule == "longest") and len(live) > 0  # a live tier drafts its longest suffix
        if rule == "longest":
            assert cached.stats["queries"] < plain.stats["queries"] / 2, (cached.stats, plain.stats)


def test_a_new_version_forgets_what_the_keys_held(db_dsn: str) -> None:
    publish(db_dsn, "demo", ROWS)
    with Store.connect(db_dsn, "demo", timeout=2.0, refresh_interval=0.0, rule="longest") as store:
        known = store.draft([1, 4, 5])
        assert known is not None and int(known.tokens[0]) == 200
        publish(db_dsn, "demo", {(4, 5): chain_tree(500, 3), (5,): chain_tree(100, 4)})
        followed = store.draft([2, 4, 5])  # a tail never seen, a key the old version held
        assert followed is not None and int(followed.tokens[0]) == 500
