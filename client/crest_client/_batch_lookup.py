"""One lookup statement for many contexts and tiers, and the one stored row each context drafts from.

The keys of each context's suffixes that a version's key filter may hold are probed in one prepared statement
(`crest_client.lookup.lookup_sql`; a batch of one context of one tier as a probe statement of plain parameters);
per context it returns the longest stored suffix's row, or with the `expected` rule on an older store every
stored one, among which `crest_client.choice` picks. Tree blobs are decoded with the version's token table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from crest_client._connections import Connections
from crest_client.choice import built_max_matches, choose, decided_at_ingest, rule_for
from crest_client.draft import Draft
from crest_client.info import StoreInfo
from crest_client.lookup import (
    BYTEA_ARRAY,
    INT4_ARRAY,
    bytea_array,
    candidate_keys,
    decode_rows,
    int4_array,
    lookup_sql,
    numbered,
)

Row = tuple[int, int, int, int, bytes]  # (context index, part, n, count, tree)


def fetch_drafts(
    conns: Connections,
    infos: list[StoreInfo],
    tails: list[tuple[int, ...]],
    missing: list[list[int]],
    *,
    rule: str,
    stats: dict[str, int],
    corrupt: Callable[[str], None],
) -> dict[tuple[int, int], Draft | None]:
    """Look the missing contexts up in one statement; return {(tier, context index): draft} for each looked up."""
    params: list[Any] = []
    probes = 0
    for part, info in enumerate(infos):
        index, keys = candidate_keys([tails[i] for i in missing[part]], info)
        params += [[missing[part][j] for j in index], keys]
        probes += len(keys)
    if not probes:
        return {}
    stats["queries"] += 1
    everys = [fetches_every(info, rule) for info in infos]
    single = len(infos) == 1 and len(set(params[0])) == 1  # a batch of one: the probe statement
    name, query = _statement(tuple(info.id for info in infos), len(params[1]) if single else None, any(everys))
    if single:
        types, values = [_BYTEA] * len(params[1]), params[1]
    else:
        types = [INT4_ARRAY, BYTEA_ARRAY] * len(infos)
        values = [int4_array(p) if j % 2 == 0 else bytea_array(p) for j, p in enumerate(params)]
    res = conns.run_prepared(name, query, types, values)
    get = res.get_value
    rows: list[Row] = [  # a probe statement's context index is 0: its context's is the one looked up
        (params[0][0] if single else _int(get(r, 0)), _int(get(r, 1)), _int(get(r, 2)), _int(get(r, 3)), get(r, 4))
        for r in range(res.ntuples)
    ]
    found: dict[tuple[int, int], Draft | None] = {}
    for part, info in enumerate(infos):
        mine = rows if len(infos) == 1 else [row for row in rows if row[1] == part]
        chosen = pick_rows(mine, info, every=everys[part])
        for (i, *_), draft in zip(chosen, _decoded([(r[2], r[4]) for r in chosen], info, corrupt), strict=True):
            found[(part, i)] = draft
    return found


def fetches_every(info: StoreInfo, rule: str) -> bool:
    """Return whether a lookup of this version fetches every stored suffix (the `expected` rule's choice).

    A live tier always drafts from its longest stored suffix (`crest_client.choice.rule_for`).
    """
    return rule_for(info.tier, rule) != "longest" and not decided_at_ingest(info.params)


def pick_rows(rows: list[Row], info: StoreInfo, *, every: bool) -> list[Row]:
    """Return one row per context: its longest stored suffix's, or with `every` the `expected` rule's choice."""
    if len(rows) < 2:
        return rows
    if not every:
        best: dict[int, Row] = {}
        for row in rows:  # longest first per context; a batch statement with `every` for another tier
            if row[0] not in best or row[2] > best[row[0]][2]:
                best[row[0]] = row
        return list(best.values())
    groups: dict[int, list[Row]] = {}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
    limit = built_max_matches(info.params)
    return [group[choose([(r[2], r[3], r[4]) for r in group], max_matches=limit)] for group in groups.values()]


def _decoded(rows: list[tuple[int, bytes]], info: StoreInfo, corrupt: Callable[[str], None]) -> list[Draft | None]:
    """Decode many (n, tree) rows at once (a corrupt tree is a miss, handed to `corrupt`)."""
    drafts, errors = decode_rows(rows, info)
    for error in errors:
        corrupt(str(error))
    return drafts


_BYTEA = 17  # type oid


@functools.lru_cache(maxsize=256)
def _statement(ids: tuple[int, ...], probes: int | None, every: bool) -> tuple[bytes, bytes]:
    """Return the prepared statement's (name, libpq SQL) for a lookup shape (`crest_client.lookup.lookup_sql`)."""
    name, query = lookup_sql(ids, probes, every=every)
    return name.encode(), numbered(query).encode()


def _int(value: bytes) -> int:
    """Return a binary int2/int4 result value."""
    return int.from_bytes(value, "big", signed=True)
