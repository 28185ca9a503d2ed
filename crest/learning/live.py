"""The live tier: a store version built from the last W tokens the store served, published beside its static one.

`refresh_live` holds the store's refresh lock (a session advisory lock; a second refresh of the same store
skips instead of waiting), returns None when nothing was learned since the published live version's
`through_id` (or fewer than `min_new_tokens` tokens), else reads the window (of each learned row the prompt's
last max-n tokens and the output: `crest.learning.journal.counted_from`) and builds it with
`crest.ingest.pipeline.build_store` as a `live` version: the static version's tokenizer (fingerprint, size,
vocabulary copied from it) and build options, keeping the n-grams seen at least `min_count` times, at most
`max_ngrams` of each n. Its tokens are ranked by `crest.learning.incremental.live_token_table`, which does
not follow the window, so a refresh is incremental (see `crest.learning.incremental`): the rows of n-grams
that no new or departed learned row touches are copied from the previous live version, the rest are built,
and the result equals a full rebuild of the window; `params["build"]` records which it was, the rows reused
and built. When the static version has a dense part, the live version gets one too, from the last
`dense_window` hidden states a server recorded with the tokens it served (`crest.learning.live_dense`). It is
published in one transaction that retires only the previous live version, so a refresh killed at any point
leaves the previous live version (and its dense part) published; the retired one is then dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from crest_client.choice import built_rule

from crest import db
from crest.config import (
    DEFAULT_LEARN_DENSE_WINDOW,
    DEFAULT_LEARN_WINDOW,
    DEFAULT_TOP_T,
    IngestOptions,
    check_store_name,
)
from crest.db.versions import refresh_lock_key
from crest.errors import ConfigError, StoreNotFound
from crest.ingest.loader import Reporter
from crest.ingest.pipeline import CHUNK_TOKENS, Vocabulary, build_store
from crest.learning.incremental import LIVE_TABLE, PreviousRows, live_token_table, plan, read_learned
from crest.learning.journal import new_since
from crest.learning.live_dense import live_dense

log = logging.getLogger(__name__)

DEFAULT_MIN_COUNT = 2  # an n-gram seen once in the window drafts what its one occurrence did, rarely right


@dataclass
class RefreshResult:
    """What a refresh published: the live version, the learned rows and tokens it was built from, its size."""

    store: str
    store_id: int
    replaced: int | None  # the live version it retired
    from_id: int
    through_id: int
    rows: int
    tokens: int
    new_rows: int
    ngrams: int
    table_bytes: int
    index_bytes: int
    seconds: float
    mode: str = "full"  # or incremental: rows copied from the replaced live version
    reused: int = 0
    built: int = 0
    dense_rows: int = 0  # entries of its dense part (`crest.learning.live_dense`; 0: none)


def refresh_live(
    dsn: str,
    store: str,
    *,
    window: int = DEFAULT_LEARN_WINDOW,
    min_new_tokens: int = 0,
    min_count: int = DEFAULT_MIN_COUNT,
    max_ngrams: int = DEFAULT_TOP_T,
    chunk_tokens: int = CHUNK_TOKENS,
    reporter: Reporter | None = None,
    incremental: bool = True,
    dense_window: int = DEFAULT_LEARN_DENSE_WINDOW,
    on_busy: Callable[[], None] | None = None,
) -> RefreshResult | None:
    """Build and publish a live version of `store` from its last `window` learned tokens; None when skipped.

    With a dense part in the static version, the live version gets one from the last `dense_window` recorded states.
    `on_busy` is called when it is skipped because another refresh of the store holds its lock.
    """
    check_store_name(store)
    for label, value, low in (
        ("--window", window, 1),
        ("--min-new-tokens", min_new_tokens, 0),
        ("--min-count", min_count, 1),
        ("--max-ngrams", max_ngrams, 1),
        ("--dense-window", dense_window, 0),
    ):
        if value < low:
            raise ConfigError(f"{label} must be at least {low}, got {value}")
    with db.session(dsn, autocommit=True) as conn:
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", refresh_lock_key(store)).fetchone()
        if not (got and got[0]):
            log.info("store %r: another refresh is running, skipped", store)
            if on_busy is not None:
                on_busy()
            return None
        try:
            return _refresh(
                conn,
                dsn,
                store,
                window=window,
                min_new_tokens=min_new_tokens,
                min_count=min_count,
                max_ngrams=max_ngrams,
                chunk_tokens=chunk_tokens,
                reporter=reporter,
                incremental=incremental,
                dense_window=dense_window,
            )
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", refresh_lock_key(store))


def _refresh(
    conn: psycopg.Connection[Any],
    dsn: str,
    store: str,
    *,
    window: int,
    min_new_tokens: int,
    min_count: int,
    max_ngrams: int,
    chunk_tokens: int,
    reporter: Reporter | None,
    incremental: bool,
    dense_window: int,
) -> RefreshResult | None:
    db.clean_leftovers(conn, name=store, tier="live")  # a killed refresh's build
    static = published_version(conn, store, "static")
    if static is None:
        raise StoreNotFound(f"no published store named {store!r}")
    live = published_version(conn, store, "live")
    after = int(live["params"].get("through_id", 0)) if live else 0
    built = static_options(static["params"])  # max_n: what of each learned row's prompt is counted
    new_rows, new_tokens, newest = new_since(conn, store, after, max_n=built.max_n)
    if new_rows == 0 or new_tokens < min_new_tokens:
        return None
    vocab_size = int(static["vocab_size"])
    down_to = int(live["params"].get("from_id", newest + 1)) if live else newest + 1
    learned = read_learned(
        conn, store, window=window, max_n=built.max_n, through_id=newest, vocab_size=vocab_size, down_to=down_to
    )
    win = learned.window
    if win.n_tokens == 0:
        return None
    vocab = conn.execute(
        "SELECT token_id, piece FROM crest_vocab WHERE store_id = %s ORDER BY token_id", (static["id"],)
    )
    pieces = [(int(i), str(p)) for i, p in vocab]
    vocabulary = Vocabulary(
        spec=str(static["tokenizer"]),
        fingerprint=str(static["tokenizer_fingerprint"]),
        size=int(static["vocab_size"]),
        pieces=lambda: pieces,
    )
    options = dataclasses.replace(built, top_t=max_ngrams, budget=None, suffix_rule=live_suffix_rule(built.suffix_rule))
    how = plan(learned, live, static_id=int(static["id"]), options=options, incremental=incremental)
    reuse = PreviousRows(how, vocab_size=vocab_size, options=options)
    params = {
        "tier": "live",
        "from_id": win.from_id,
        "through_id": newest,
        "window": window,
        "min_count": min_count,
        "max_ngrams": max_ngrams,
        "static_version": int(static["id"]),
        "window_rows": win.rows,
        "token_table": LIVE_TABLE,
        "dense_window": dense_window,
    }
    dense = live_dense(conn, store, static_id=int(static["id"]), through_id=newest, window=dense_window)
    summary = build_store(
        win.tokens,
        win.offsets,
        store=store,
        dsn=dsn,
        vocabulary=vocabulary,
        options=options,
        tier="live",
        params=params,
        min_count=min_count,
        allow_empty=True,  # nothing seen twice yet: an empty live version still records through_id
        reporter=reporter,
        chunk_tokens=chunk_tokens,
        token_table=live_token_table(conn, int(static["id"]), vocab_size),
        reuse=reuse,
        before_publish=dense.build if dense is not None else None,
    )
    db.clean_leftovers(conn, name=store, tier="live")  # the live version it replaced
    return RefreshResult(
        store=store,
        store_id=summary.store_id,
        replaced=int(live["id"]) if live else None,
        from_id=win.from_id,
        through_id=newest,
        rows=win.rows,
        tokens=win.n_tokens,
        new_rows=new_rows,
        ngrams=summary.rows,
        table_bytes=summary.table_bytes,
        index_bytes=summary.index_bytes,
        seconds=round(sum(summary.seconds.values()), 3),
        mode="full" if how.previous is None else "incremental",
        reused=reuse.reused,
        built=summary.rows - reuse.reused,
        dense_rows=dense.rows if dense is not None else 0,
    )


def published_version(conn: psycopg.Connection[Any], store: str, tier: str) -> dict[str, Any] | None:
    """Return the published version of `store` in `tier` as a dict of its crest_stores columns, or None."""
    cur = conn.execute(
        "SELECT id, tokenizer, tokenizer_fingerprint, vocab_size, token_width, params FROM crest_stores"
        " WHERE name = %s AND tier = %s AND state = 'published'",
        (store, tier),
    )
    row = cur.fetchone()
    if row is None:
        return None
    return dict(zip([c.name for c in cur.description or []], row, strict=True))


def live_suffix_rule(static_rule: str) -> str:
    """Return the suffix rule a live version is built with: its static version's, but never `prune`.

    The live tier is read by its longest stored suffix (`crest_client.store`); pruning by the `expected` rule's
    choice would drop exactly the long, fresh rows it drafts from, so a pruned static store gets an unpruned live tier.
    """
    return "lookup" if static_rule in ("prune", "auto") else static_rule


def static_options(params: dict[str, Any]) -> IngestOptions:
    """Return the build options recorded in a version's params (other keys ignored)."""
    names = {f.name for f in dataclasses.fields(IngestOptions)}
    recorded = {k: v for k, v in params.items() if k in names}
    recorded["suffix_rule"] = built_rule(params)
    return IngestOptions(**recorded)
