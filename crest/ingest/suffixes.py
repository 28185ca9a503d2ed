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
all its suffixes were copied too). With `--suffix-rule prune` each row keeps its own tree, and only the rows the
client's `expected` rule would ever draft from are kept: g stays when it outranks (`crest_client.choice.rank`)
the most promising of its stored proper suffixes (1-grams, with none, always stay). The rule's score depends on
the row alone, so the longest kept suffix of any context is the suffix `expected` chooses on the whole build: one
row per lookup drafts what `expected` drafts, from the rows that can win. The decision is made on every row
(copied ones too): it depends only on the rows built, which an incremental refresh builds as a full one does. The
Spark engine applies the same `kept_by_prune` on its executors (`crest.ingest.spark_prune`). With `--suffix-rule
auto` the build prunes, or keeps every row, as `crest.ingest.suffix_choice` chooses (on a held-out slice, before the
build, or on a judge corpus, on the build's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
from crest_client.choice import rank
from crest_client.codec import TokenTable, decode_tree, encode_tree, tree_nodes
from crest_client.draft import Draft
from crest_client.merge import merge_drafts
from crest_client.order import chain_order
from psycopg import sql

from crest import db
from crest.config import IngestOptions

BACKOFF_SCALE = 127  # integer weight of a back-off tree's whole mass: weights 1..127

Row = tuple[bytes, int, int, bytes]  # (key, n, count, tree) as stored
Rank = tuple[float, int]  # the `expected` rule's sort key of a row (crest_client.choice.rank)
Choose = Callable[[Sequence[Row], Sequence[bool]], dict[str, Any]]  # (rows by n, prune's mask) -> auto's choice
T = TypeVar("T")


class Resolved(NamedTuple):
    """What a suffix rule left in a build: nodes and blob bytes of its rows, and the rows it dropped."""

    nodes: int
    blob_bytes: int
    dropped: dict[bytes, int]  # key -> count of each row deleted (`prune`)
    choice: dict[str, Any] | None = None  # `auto`: crest.ingest.suffix_choice.Choice's figures


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
    choose: Choose | None = None,
) -> Resolved | None:
    """Rewrite the build's rows as `options.suffix_rule` decides; return what is left (None with `lookup`).

    `decided` holds the keys of rows copied already decided (`backoff`; `prune` decides on every row); `choose`
    returns the figures of the rule `auto` keeps, given the rows and prune's mask (`crest.ingest.suffix_choice`).
    """
    if options.suffix_rule == "lookup":
        return None
    if (options.suffix_rule == "auto") != (choose is not None):
        raise ValueError("a choice resolves an `auto` build, and only one")
    ngrams = db.ngram_table(build.store_id)
    with build.conn.transaction():
        found = build.conn.execute(
            sql.SQL("SELECT key, n, count, tree FROM {} ORDER BY n").format(ngrams), binary=True
        ).fetchall()
    rows: list[Row] = [(bytes(k), int(n), int(c), bytes(t)) for k, n, c, t in found]
    dropped: dict[bytes, int] = {}
    choice = None
    if options.suffix_rule in ("prune", "auto"):
        keep = prune_mask(rows, width=width, max_matches=options.max_matches)
        if choose is not None:
            choice = choose(rows, keep)
            if choice["rule"] == "longest":  # every row stays, read by its longest stored suffix: no rewrite
                return Resolved(sum(tree_nodes(r[3]) for r in rows), sum(len(r[3]) for r in rows), {}, choice)
        dropped = {r[0]: r[2] for r, kept in zip(rows, keep, strict=True) if not kept}
        rows = [r for r, kept in zip(rows, keep, strict=True) if kept]
        nodes = sum(tree_nodes(r[3]) for r in rows)
    else:
        rows, nodes = _backoff_rows(
            rows, options=options, vocab_size=vocab_size, table=table, width=width, decided=decided
        )
    with build.conn.transaction():
        build.conn.execute(sql.SQL("TRUNCATE {}").format(ngrams))
    build.copy_ngrams(_rows(rows))
    return Resolved(nodes, sum(len(r[3]) for r in rows), dropped, choice)


def prune_mask(rows: Sequence[Row], *, width: int, max_matches: int) -> list[bool]:
    """Return, for rows ordered by n, whether the `expected` rule would ever draft from each (`prune`).

    The best rank among a row's stored proper suffixes is the best of its longest stored proper suffix and that
    suffix's own suffixes, so one pass, shortest first.
    """
    best: dict[bytes, Rank] = {}  # key -> the best rank of it and its stored suffixes
    keep: list[bool] = []
    for key, n, count, tree in rows:
        own = rank(n, count, tree, max_matches=max_matches)
        suffix = _suffix(key, width, best)
        keep.append(kept_by_prune(own, suffix))
        best[key] = own if suffix is None else max(own, suffix)
    return keep


def kept_by_prune(own: Rank, suffixes: Rank | None) -> bool:
    """Return whether `prune` keeps a row of rank `own` whose stored proper suffixes' best rank is `suffixes`.

    `choose` drafts from it when it outranks all of them (on a tie in promise the longer row wins); 1-grams stay.
    """
    return suffixes is None or own > suffixes


def _backoff_rows(
    rows: list[Row],
    *,
    options: IngestOptions,
    vocab_size: int,
    table: TokenTable,
    width: int,
    decided: Collection[bytes],
) -> tuple[list[Row], int]:
    """Return the rows with their back-off trees (`backoff`), and their nodes."""
    ranked = table if options.blob_format == 2 else None
    blobs: dict[bytes, bytes] = {}  # key -> decided blob, lengths done so far
    out: list[Row] = []
    nodes = 0
    for key, n, count, tree in rows:
        own = decode_tree(tree, n=n, table=ranked)
        if key not in decided:
            suffix = _suffix(key, width, blobs)
            if suffix is not None:
                decided_tree = backoff_tree(own, decode_tree(suffix, table=ranked), count=count, options=options)
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
        out.append((key, n, count, tree))
    return out, nodes


def _suffix(key: bytes, width: int, decided: Mapping[bytes, T]) -> T | None:
    """Return what was decided for the key's longest stored proper suffix, or None."""
    for cut in range(width, len(key), width):
        found = decided.get(key[cut:])
        if found is not None:
            return found
    return None


def _rows(rows: list[Row]) -> Iterator[Row]:
    yield from rows
