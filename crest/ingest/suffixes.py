"""Deciding at ingest which tree each stored n-gram's row holds, so a lookup fetches exactly one row.

A context is looked up by its longest stored suffix g (the key filter finds it), so g's row should hold the tree
that drafts best for every context whose longest stored suffix is g. With `--suffix-rule lookup` it holds g's own
tree and the client's lookup rule (`crest_client.choice`: `expected` weighs every stored suffix, fetched in the
same statement) decides per lookup. With `--suffix-rule backoff` the decision is made once, here: g's row holds
the interpolated back-off tree of g and its suffixes, as n-gram language models back off (Witten-Bell),

    tree(g) = merge(own(g) with share lam, tree(s) with share 1 - lam),  lam = c / (c + u),

where s is g's longest stored proper suffix (whose row was decided first: lengths are done shortest first), c the
occurrences g's own tree was built from (its count, at most max_matches) and u the distinct tokens that follow g in
that tree. A common n-gram followed by few tokens keeps nearly its own tree; a rare one leans on its suffix's
richer tree; an n-gram none of whose suffixes is stored keeps its own. The merge is `crest_client.merge`'s (a
node's weight is each tree's share of continuations through it, weighted), scaled to `BACKOFF_SCALE` (a first
weight under 128 is one header byte and keeps the blob on the SDK's batch decoder's fast path; the estimates need
no finer grain), cut to the tree size and stored in the stored-tree order. Rows the live tier's incremental
refresh copied from its previous version were decided there and are kept (a row is copied only when the rows of
all its suffixes were copied too).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import numpy as np
from crest_client.codec import TokenTable, decode_tree, encode_tree
from crest_client.draft import Draft
from crest_client.merge import merge_drafts
from crest_client.order import chain_order
from psycopg import sql

from crest import db
from crest.config import IngestOptions

BACKOFF_SCALE = 127  # integer weight of a back-off tree's whole mass: weights 1..127


def backoff_share(count: int, followers: int, *, max_matches: int) -> float:
    """Return an n-gram's own tree's share in its back-off tree (Witten-Bell: c / (c + distinct followers))."""
    c = max(1, min(int(count), int(max_matches)))
    return c / (c + max(1, int(followers)))


def backoff_tree(own: Draft, suffix: Draft | None, *, count: int, options: IngestOptions) -> Draft:
    """Return the back-off tree of an n-gram from its own tree and its longest stored suffix's decided tree."""
    if suffix is None or len(suffix) == 0:
        return own
    lam = backoff_share(count, int(np.count_nonzero(own.parents < 0)), max_matches=options.max_matches)
    merged = merge_drafts([own, suffix], shares=[lam, 1.0 - lam], tree_size=options.tree_size, scale=BACKOFF_SCALE)
    return Draft(merged.tokens, merged.parents, merged.weights, own.n)


def stored_order(draft: Draft) -> Draft:
    """Return a tree in canonical order refined for storage (equal-weight chains contiguous, `chain_order`)."""
    if len(draft) == 0:
        return draft
    keep = np.arange(len(draft), dtype=np.int64)
    order = chain_order(keep, draft.parents.astype(np.int64), draft.weights, draft.depths())
    position = np.empty(len(draft), dtype=np.int64)
    position[order] = np.arange(len(draft))
    up = draft.parents[order]
    parents = np.where(up >= 0, position[np.maximum(up, 0)], -1).astype(np.int32)
    return Draft(draft.tokens[order], parents, draft.weights[order], draft.n)


def resolve_build(
    build: db.Build,
    *,
    options: IngestOptions,
    vocab_size: int,
    table: TokenTable,
    width: int,
    decided: Collection[bytes] = (),
) -> tuple[int, int] | None:
    """Rewrite the build's rows with the trees `options.suffix_rule` decides; return (nodes, blob bytes) of all rows.

    None (nothing rewritten) with the `lookup` rule. `decided` holds the keys of rows copied already decided.
    """
    if options.suffix_rule == "lookup":
        return None
    ngrams = db.ngram_table(build.store_id)
    with build.conn.transaction():
        rows = build.conn.execute(
            sql.SQL("SELECT key, n, count, tree FROM {} ORDER BY n").format(ngrams), binary=True
        ).fetchall()
    ranked = table if options.blob_format == 2 else None
    blobs: dict[bytes, bytes] = {}  # key -> decided blob, lengths done so far
    out: list[tuple[bytes, int, int, bytes]] = []
    nodes = 0
    for key, n, count, tree in rows:
        key, tree = bytes(key), bytes(tree)
        own = decode_tree(tree, n=int(n), table=ranked)
        if key not in decided:
            suffix = _suffix(key, width, blobs)
            if suffix is not None:
                decided_tree = backoff_tree(own, decode_tree(suffix, table=ranked), count=int(count), options=options)
                own = stored_order(decided_tree)
                tree = encode_tree(
                    own.tokens,
                    own.parents,
                    own.weights,
                    vocab_size=vocab_size,
                    table=ranked,
                    version=options.blob_format,
                )
        blobs[key] = tree
        nodes += len(own)
        out.append((key, int(n), int(count), tree))
    with build.conn.transaction():
        build.conn.execute(sql.SQL("TRUNCATE {}").format(ngrams))
    build.copy_ngrams(_rows(out))
    return nodes, sum(len(r[3]) for r in out)


def _suffix(key: bytes, width: int, blobs: dict[bytes, bytes]) -> bytes | None:
    """Return the decided blob of the key's longest stored proper suffix, or None."""
    for cut in range(width, len(key), width):
        found = blobs.get(key[cut:])
        if found is not None:
            return found
    return None


def _rows(rows: list[tuple[bytes, int, int, bytes]]) -> Iterator[tuple[bytes, int, int, bytes]]:
    yield from rows
