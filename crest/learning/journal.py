"""The journal of what stores served: `crest_learned`, an append-only log of token lists, one row per request.

`append_learned` writes token lists with one COPY in one transaction (all or nothing; the reader role may do
it, it holds INSERT on this table alone). Tokens are stored as little-endian uint32, `n_tokens` beside them;
`prompt_tokens` says how many leading ids were prompt context rather than served output, and `stats` (per row,
optional) the figures of the request that served it (`crest_client.learner.STATS`, 0 when not given, and
`accepted_<part>` per drafter part into the jsonb `accepted_parts`; `crest_client.learner.split_stats`). A row keeps
more of its prompt than the live tier counts (a server's, `crest.learning.requests.PROMPT_TAIL` tokens, for the
recent tiers that read rows whole): what counts of a row is its tokens from `counted_from` on, the prompt's last
max-n and the output, so a long prompt repeated in every request never becomes served text. `read_window` returns
the most recent W counted tokens of a store as one token array with document offsets (a row is a document), the
form `crest.ingest.pipeline.build_store` takes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from crest_client.learner import STATS, split_stats
from psycopg.types.json import Jsonb

from crest import db
from crest.config import check_store_name
from crest.errors import ConfigError, DatabaseError

log = logging.getLogger(__name__)

_MAX_ID = 2**32 - 1
_FETCH_ROWS = 2000


@dataclass
class Window:
    """The last learned tokens of a store: document d is tokens[offsets[d]:offsets[d + 1]], oldest first."""

    tokens: np.ndarray  # [N] int32
    offsets: np.ndarray  # [D + 1] int64
    from_id: int  # id of the oldest row in the window (its oldest tokens may be cut off)
    through_id: int  # id of the newest row read (included, or left out for ids outside the vocabulary)
    rows: int

    @property
    def n_tokens(self) -> int:
        """Return how many tokens the window holds."""
        return int(self.tokens.shape[0])


def counted_from(prompt_tokens: int, *, max_n: int) -> int:
    """Return where the counted part of a learned row with `prompt_tokens` of context starts (its prompt's last max_n).

    `COUNTED_TOKENS` is the same rule in SQL.
    """
    return max(0, int(prompt_tokens) - max_n)


# a row's counted tokens (`counted_from`) in SQL, `max_n` a named parameter
COUNTED_TOKENS = "n_tokens - greatest(prompt_tokens - %(max_n)s, 0)"


def encode_tokens(ids: Sequence[int] | np.ndarray) -> bytes:
    """Return token ids as little-endian uint32 bytes (raise ConfigError on an id outside 0..2**32-1)."""
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ConfigError("learned tokens must be a flat list of integer token ids")
    if array.size and (int(array.min()) < 0 or int(array.max()) > _MAX_ID):
        raise ConfigError("learned token ids must lie in 0..2**32-1")
    return array.astype("<u4").tobytes()


def decode_tokens(data: bytes) -> np.ndarray:
    """Return the token ids [N] int64 of a learned row's bytes."""
    return np.frombuffer(data, dtype="<u4").astype(np.int64)


def append_learned(
    conn_or_dsn: psycopg.Connection[Any] | str,
    store: str,
    token_lists: Sequence[Sequence[int] | np.ndarray],
    *,
    prompt_tokens: int | Sequence[int] = 0,
    source: str = "",
    stats: Sequence[Mapping[str, int] | None] | None = None,
) -> int:
    """Append one row per non-empty token list to the store's learned log, all or none; return rows written."""
    check_store_name(store)
    prompts = [prompt_tokens] * len(token_lists) if isinstance(prompt_tokens, int) else list(prompt_tokens)
    if len(prompts) != len(token_lists):
        raise ConfigError(f"{len(prompts)} prompt_tokens for {len(token_lists)} token lists")
    figures = [None] * len(token_lists) if stats is None else list(stats)
    if len(figures) != len(token_lists):
        raise ConfigError(f"{len(figures)} stats for {len(token_lists)} token lists")
    rows = []
    for ids, prompt, given in zip(token_lists, prompts, figures, strict=True):
        data = encode_tokens(ids)
        n = len(data) // 4
        if not 0 <= int(prompt) <= n:
            raise ConfigError(f"prompt_tokens {prompt} is not between 0 and the row's {n} tokens")
        if n:
            rows.append((store, data, n, int(prompt), source, *(() if stats is None else _stats_row(given))))
    if not rows:
        return 0
    if isinstance(conn_or_dsn, str):
        with db.session(conn_or_dsn) as conn:
            return _copy_rows(conn, rows, with_stats=stats is not None)
    try:
        return _copy_rows(conn_or_dsn, rows, with_stats=stats is not None)
    except psycopg.Error as exc:
        raise DatabaseError(f"could not append to the learned log: {str(exc).strip()}") from None


def _stats_row(given: Mapping[str, int] | None) -> tuple[Any, ...]:
    """Return a row's figures in `STATS` order (0 where not given) and its parts; raise ConfigError on a bad one."""
    try:
        values, parts = split_stats(given or {})
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return (*values, Jsonb(parts))


def _copy_rows(conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]], *, with_stats: bool) -> int:
    # without figures: the columns' defaults, and the INSERT rights of schema 0003
    figures = (*STATS, "accepted_parts") if with_stats else ()
    columns = ", ".join(("store", "tokens", "n_tokens", "prompt_tokens", "source", *figures))
    with (
        conn.transaction(),
        conn.cursor() as cur,
        cur.copy(f"COPY crest_learned ({columns}) FROM STDIN (FORMAT BINARY)") as copy,
    ):
        types = ["int4"] * len(STATS) + ["jsonb"] if with_stats else []
        copy.set_types(["text", "bytea", "int4", "int4", "text", *types])
        for row in rows:
            copy.write_row(row)
    return len(rows)


def new_since(conn: psycopg.Connection[Any], store: str, after_id: int, *, max_n: int) -> tuple[int, int, int]:
    """Return (rows, counted tokens, newest id) of the store's learned rows with an id above `after_id`."""
    row = conn.execute(
        f"SELECT count(*), coalesce(sum({COUNTED_TOKENS}), 0), coalesce(max(id), 0) FROM crest_learned"
        " WHERE store = %(store)s AND id > %(after)s",
        {"store": store, "after": after_id, "max_n": max_n},
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def read_window(
    conn: psycopg.Connection[Any],
    store: str,
    *,
    window: int,
    max_n: int,
    through_id: int | None = None,
    vocab_size: int | None = None,
) -> Window:
    """Return the store's last `window` counted tokens (rows up to `through_id`), a row cut at the window's start.

    A row's counted tokens are those from `counted_from` on; rows holding an id of `vocab_size` or more there (not
    the store's tokenizer) are left out.
    """
    if window < 1:
        raise ConfigError(f"the learning window must be a positive number of tokens, got {window}")
    check_store_name(store)
    parts: list[np.ndarray] = []
    ids: list[int] = []
    total = skipped = newest = 0
    with conn.transaction(), conn.cursor(name="crest_learned_window") as cur:
        cur.itersize = _FETCH_ROWS
        cur.execute(
            "SELECT id, tokens, prompt_tokens FROM crest_learned WHERE store = %s AND id <= %s ORDER BY id DESC",
            (store, 2**63 - 1 if through_id is None else through_id),
        )
        for sid, data, prompt in cur:  # newest first
            newest = max(newest, int(sid))
            tokens = np.frombuffer(bytes(data), dtype="<u4")[counted_from(prompt, max_n=max_n) :]
            if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
                skipped += 1
                continue
            take = min(len(tokens), window - total)
            parts.append(tokens[len(tokens) - take :])
            ids.append(int(sid))
            total += take
            if total >= window:
                break
    parts.reverse()
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    if skipped:
        log.warning("left %d learned rows of store %r out: they hold ids outside its vocabulary", skipped, store)
    return Window(tokens, offsets, from_id=min(ids, default=0), through_id=newest, rows=len(ids))
