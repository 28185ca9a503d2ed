"""Incremental refresh of a live version: what the previous one built that the new window leaves unchanged.

An n-gram's row (count, tree) depends only on its occurrences in the window, each with the continuation after
it inside its own learned row, and on the token table. Live versions rank tokens by a table that does not
follow the window (`live_token_table`: the static version's ranking, then every other id ascending), so the
rows of two windows agree wherever the occurrences agree. The changed rows are those of one window and not
wholly of the other: new rows, rows that left, and the oldest row of each (it may be cut). A selected n-gram
that occurs in none of them, was loaded by the previous live version with the same count and has at most
`max_matches` occurrences (a sample above that picks absolute positions, which shift as rows leave) keeps its
row: `PreviousRows` copies it in SQL; every other n-gram is built as a full rebuild builds it, so the result
equals a full rebuild of the same window row for row. `plan` falls back to a full rebuild when there is no
previous live version, it was built from another static version or with other options, rows were committed
late inside its window (ids are not commit order), or more than `MAX_CHANGED` of the window changed. A live tier
is never pruned (`crest.learning.live.live_suffix_rule`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from crest_client.codec import TokenTable, token_width
from psycopg import sql

from crest import db
from crest.config import IngestOptions, fault_pause
from crest.ingest.ngrams import count_ngrams
from crest.ingest.pipeline import IngestSummary
from crest.learning.journal import Window, counted_from

LIVE_TABLE = "static-ranks"  # params["token_table"] of live versions ranked by `live_token_table`
MAX_CHANGED = 0.5  # share of the window's tokens in changed rows above which a full rebuild is cheaper
_FETCH_ROWS = 2000

# node count of a stored tree from its header: format 1 (u8 or, flag 0x80, u16) or 2 (LEB128, < 2**16)
_NODES = """CASE WHEN get_byte(tree, 0) = 1 THEN
  CASE WHEN (get_byte(tree, 1) & 128) = 0 THEN get_byte(tree, 2) ELSE get_byte(tree, 2) | (get_byte(tree, 3) << 8) END
 WHEN get_byte(tree, 2) < 128 THEN get_byte(tree, 2)
 WHEN get_byte(tree, 3) < 128 THEN (get_byte(tree, 2) & 127) | (get_byte(tree, 3) << 7)
 ELSE (get_byte(tree, 2) & 127) | ((get_byte(tree, 3) & 127) << 7) | (get_byte(tree, 4) << 14) END"""


@dataclass
class Learned:
    """A window of learned rows (as `read_window` returns it) with the row ids and the rows around it."""

    window: Window
    ids: np.ndarray  # [D] learned row id of each document, oldest first
    cut: np.ndarray | None  # all tokens of the oldest row when the window holds only its end
    below: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (id, tokens) of rows older than the window


def read_learned(
    conn: psycopg.Connection[Any],
    store: str,
    *,
    window: int,
    max_n: int,
    through_id: int,
    vocab_size: int,
    down_to: int,
) -> Learned:
    """Return the store's last `window` counted tokens up to `through_id`, and the older rows down to `down_to`.

    The window is `crest.learning.journal.read_window`'s: each row's counted tokens (`counted_from`: the prompt's
    last max_n and the output), rows newest first, those holding an id of `vocab_size` or more left out, the oldest
    one cut to fill the window exactly.
    """
    parts: list[np.ndarray] = []
    ids: list[int] = []
    below: list[tuple[int, np.ndarray]] = []
    cut: np.ndarray | None = None
    total = newest = 0
    with conn.transaction(), conn.cursor(name="crest_learned_incremental") as cur:
        cur.itersize = _FETCH_ROWS
        cur.execute(
            "SELECT id, tokens, prompt_tokens FROM crest_learned WHERE store = %s AND id <= %s ORDER BY id DESC",
            (store, through_id),
        )
        for sid, data, prompt in cur:  # newest first
            if total >= window and int(sid) < down_to:
                break
            newest = max(newest, int(sid))
            tokens = np.frombuffer(bytes(data), dtype="<u4")[counted_from(prompt, max_n=max_n) :]
            if len(tokens) and int(tokens.max()) >= vocab_size:
                continue
            if total >= window:
                below.append((int(sid), tokens))
                continue
            take = min(len(tokens), window - total)
            parts.append(tokens[len(tokens) - take :])
            ids.append(int(sid))
            cut = tokens if take < len(tokens) else None
            total += take
    parts.reverse()
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    win = Window(tokens, offsets, from_id=min(ids, default=0), through_id=newest, rows=len(ids))
    return Learned(win, np.array(ids[::-1], dtype=np.int64), cut, below)


def live_token_table(conn: psycopg.Connection[Any], static_id: int, vocab_size: int) -> TokenTable:
    """Return the live tier's token table: the static version's ranking, then every other token id ascending."""
    row = conn.execute("SELECT token_table FROM crest_store_data WHERE store_id = %s", (static_id,)).fetchone()
    ranked = TokenTable.from_bytes(row[0]).tokens if row and row[0] is not None else np.zeros(0, np.int64)
    ranked = ranked[ranked < vocab_size]
    rest = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), ranked)
    return TokenTable(np.concatenate([ranked, rest]))


@dataclass
class Plan:
    """How a refresh builds: the previous live version it copies from (None: a full rebuild), and why."""

    previous: int | None
    reason: str
    changed: list[np.ndarray] = field(default_factory=list)  # token arrays of the changed rows


def plan(
    learned: Learned, previous: dict[str, Any] | None, *, static_id: int, options: IngestOptions, incremental: bool
) -> Plan:
    """Decide between an incremental refresh from the `previous` live version (crest_stores columns) and a full one."""
    if not incremental:
        return Plan(None, "asked")
    if previous is None:
        return Plan(None, "no live version")
    params = previous["params"]
    if params.get("token_table") != LIVE_TABLE or "window_rows" not in params:
        return Plan(None, "live version of an older refresh")
    if int(params.get("static_version", -1)) != static_id:
        return Plan(None, "static version changed")
    if any(params.get(k) != v for k, v in dataclasses.asdict(options).items()):
        return Plan(None, "build options changed")
    first, last = int(params["from_id"]), int(params["through_id"])
    win = learned.window
    lengths = np.diff(win.offsets)
    inside = (learned.ids > first) & (learned.ids <= last)  # whole rows of the previous window too
    if learned.cut is not None and inside.shape[0]:
        inside[0] = False
    seen = int(np.count_nonzero((learned.ids >= first) & (learned.ids <= last)))
    seen += sum(1 for sid, _ in learned.below if first <= sid <= last)
    if seen != int(params["window_rows"]):
        return Plan(None, "rows committed late inside the previous window")
    if int(lengths[~inside].sum()) > MAX_CHANGED * max(1, win.n_tokens):
        return Plan(None, "most of the window changed")
    changed = [win.tokens[win.offsets[d] : win.offsets[d + 1]] for d in np.flatnonzero(~inside)]
    if learned.cut is not None:
        changed.append(learned.cut)  # all of it: the previous window may have held more of it
    changed += [tokens for _, tokens in learned.below]
    return Plan(int(previous["id"]), "", changed)


def _key_bytes(ngrams: np.ndarray, width: int) -> np.ndarray:
    """Return the stored keys of n-grams [K, n] (big-endian ids, `width` bytes each) as fixed-width bytes [K]."""
    grams = np.ascontiguousarray(ngrams, dtype=np.int64)
    n = grams.shape[1]
    return grams.astype(f">u{width}").view(f"S{n * width}").reshape(-1)


class PreviousRows:
    """The `crest.ingest.pipeline.Reuse` of a live build: rows copied from the previous live version in SQL."""

    def __init__(self, plan: Plan, *, vocab_size: int, options: IngestOptions) -> None:
        self.previous = plan.previous
        self.reason = plan.reason
        self.width = token_width(vocab_size)
        self.max_matches = options.max_matches
        self.backoff = options.suffix_rule == "backoff"  # a row's tree depends on its suffixes' rows too
        self.reused = 0
        self.decided: set[bytes] = set()  # keys of the copied rows (their trees decided by the previous version)
        self._keys: dict[tuple[int, int], np.ndarray] = {}  # (version, n) -> its stored keys of length n
        self._copied: dict[int, np.ndarray] = {}  # n -> keys of the length-n rows copied
        self.changed: dict[int, np.ndarray] = {}  # n -> sorted keys of the n-grams of the changed rows
        if self.previous is not None and plan.changed:
            tokens = np.concatenate(plan.changed).astype(np.int32)
            offsets = np.zeros(len(plan.changed) + 1, dtype=np.int64)
            np.cumsum([len(t) for t in plan.changed], out=offsets[1:])
            counts = count_ngrams(tokens, offsets, max_n=options.max_n, vocab_size=vocab_size)
            self.changed = {n: np.sort(_key_bytes(counts.ngrams(n), self.width)) for n in counts.keys}

    def copy(self, build: db.Build, n: int, ngrams: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Copy the previous version's rows of the unchanged n-grams; return (mask copied, nodes, blob bytes)."""
        done = np.zeros(len(counts), dtype=bool)
        if self.previous is None:
            return done, 0, 0
        keys = _key_bytes(ngrams, self.width)
        changed = self.changed.get(n, np.zeros(0, dtype=keys.dtype))
        unchanged = ~np.isin(keys, changed)
        for k in range(1, n if self.backoff else 1):  # a row's tree hangs on its suffixes' rows: copy those first
            suffixes = _key_bytes(np.asarray(ngrams)[:, n - k :], self.width)
            absent = ~np.isin(suffixes, self._stored(build, build.store_id, k))
            unchanged &= np.isin(suffixes, self._copied.get(k, suffixes[:0])) | (
                absent & ~np.isin(suffixes, self._stored(build, self.previous, k))
            )
        wanted = np.flatnonzero((counts <= self.max_matches) & unchanged)
        if wanted.shape[0] == 0:
            return done, 0, 0
        query = sql.SQL(
            "INSERT INTO {new} (store_id, count, n, key, tree) SELECT %s, o.count, o.n, o.key, o.tree"
            " FROM {old} o JOIN unnest(%b::bytea[], %b::int4[]) AS w(key, count) ON o.key = w.key"
            " AND o.count = w.count WHERE o.n = %s RETURNING key, length(tree), " + _NODES
        ).format(new=db.ngram_table(build.store_id), old=db.ngram_table(self.previous))
        raw, size = keys[wanted].tobytes(), keys.dtype.itemsize  # not bytes(k): that drops trailing zero bytes
        params = (build.store_id, [raw[i : i + size] for i in range(0, len(raw), size)], counts[wanted].tolist(), n)
        with build.conn.transaction():
            rows = build.conn.execute(query, params, binary=True).fetchall()
        fault_pause("reuse")  # rows copied, the version not published
        if rows:
            self.decided.update(bytes(k) for k, _, _ in rows)
            copied = np.array([bytes(k) for k, _, _ in rows], dtype=keys.dtype)
            self._copied[n] = np.concatenate([self._copied.get(n, copied[:0]), copied])
            done[wanted] = np.isin(keys[wanted], copied)
        self.reused += len(rows)
        return done, sum(int(r[2]) for r in rows), sum(int(r[1]) for r in rows)

    def _stored(self, build: db.Build, version: int, n: int) -> np.ndarray:
        """Return the keys of length-n rows of a version (the new one's lengths below the one copied are complete)."""
        found = self._keys.get((version, n))
        if found is None:
            query = sql.SQL("SELECT key FROM {} WHERE n = %s").format(db.ngram_table(version))
            with build.conn.transaction():
                keys = [bytes(k) for (k,) in build.conn.execute(query, (n,), binary=True)]
            found = self._keys[(version, n)] = np.array(keys, dtype=f"S{n * self.width}")
        return found

    def record(self, build: db.Build, summary: IngestSummary) -> None:
        """Record in the build's params whether it was incremental, and the rows it reused and built."""
        how: dict[str, Any] = {
            "mode": "full" if self.previous is None else "incremental",
            "reused": self.reused,
            "built": summary.rows - self.reused,
        }
        if self.previous is None:
            how["why"] = self.reason
        else:
            how["from_version"] = self.previous
        with build.conn.transaction():
            build.conn.execute(
                "UPDATE crest_stores SET params = params || %s::jsonb WHERE id = %s",
                (json.dumps({"build": how}), build.store_id),
            )
