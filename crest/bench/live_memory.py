"""A live tier built in memory: the trees `crest.learning.refresh_live` would publish, looked up like a live version.

`learned_window` cuts learned rows (what a live tier counts of them) to the last W tokens as
`crest.learning.journal.read_window` does, and `LiveTrees.build` counts and selects n-grams and builds their trees
with the ingest pipeline's own loader (the selection, `min_count` filter, `build_trees` and blob encoding of a live
version, on the static version's build options), keeping the rows in a dict instead of copying them into a
partition. `draft` picks among the stored
suffixes of a context as the SDK reads a live tier (`crest_client.choice.rule_for`: its longest stored suffix)
and decodes the tree as `Store` does. Used by
`crest bench learn`, which rebuilds a live tier after every few requests of a stream without publishing any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from crest_client.choice import choose, resolve_rule, rule_for
from crest_client.codec import TokenTable, decode_tree, token_width
from crest_client.draft import Draft
from crest_client.lookup import suffix_keys

from crest.config import IngestOptions
from crest.ingest.disk import estimate_row_bytes, hash_index_bytes
from crest.ingest.loader import RowLoader, SilentReporter
from crest.ingest.ngrams import count_ngrams
from crest.learning.live import DEFAULT_MIN_COUNT


def learned_window(rows: Sequence[Sequence[int]], *, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the last `window` tokens of `rows` (oldest first) as tokens [N] int32 and offsets [D + 1] int64.

    The oldest row kept is cut at the window's start, as `crest.learning.journal.read_window` cuts it.
    """
    parts: list[np.ndarray] = []
    total = 0
    for row in reversed(rows):
        take = min(len(row), window - total)
        parts.append(np.asarray(row[len(row) - take :], dtype=np.int32))
        total += take
        if total >= window:
            break
    parts.reverse()
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.array([len(p) for p in parts], dtype=np.int64), out=offsets[1:])
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)), offsets


class _Rows:
    """Stands in for a store build: keeps the loader's (key, n, count, blob) rows in memory."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[int, int, bytes]] = {}

    def copy_ngrams(self, rows: Any) -> None:
        for key, n, count, blob in rows:
            self.rows[bytes(key)] = (int(n), int(count), bytes(blob))


class LiveTrees:
    """A live tier built in memory from learned tokens, looked up like a published live version."""

    def __init__(
        self,
        rows: dict[bytes, tuple[int, int, bytes]],
        table: TokenTable,
        *,
        options: IngestOptions,
        vocab_size: int,
        rule: str | None = None,
    ) -> None:
        self.rows, self.table, self.options, self.vocab_size = rows, table, options, vocab_size
        self.width = token_width(vocab_size)
        self.rule = rule_for("live", resolve_rule(rule))  # the SDK's rule for a live tier: its longest suffix

    @classmethod
    def build(
        cls,
        tokens: np.ndarray,
        offsets: np.ndarray,
        *,
        vocab_size: int,
        options: IngestOptions,
        min_count: int = DEFAULT_MIN_COUNT,
        rule: str | None = None,
    ) -> LiveTrees:
        """Count, select and build the trees of a live version over the window, as `refresh_live` does."""
        options = options.validate().with_defaults()
        counts = count_ngrams(tokens, offsets, max_n=options.max_n, vocab_size=vocab_size)
        sink = _Rows()
        # the ingest pipeline's own loader, so the selection, min_count filter and blobs are a live version's
        loader = RowLoader(sink, vocab_size, options, chunk_tokens=1 << 22, min_count=min_count)  # type: ignore[arg-type]
        if tokens.shape[0]:
            loader.load(tokens, offsets, counts, SilentReporter())
        return cls(sink.rows, loader.table, options=options, vocab_size=vocab_size, rule=rule)

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the tree of the stored suffix the rule picks (longest first on ties), or None."""
        max_n = self.options.max_n
        tail = [int(t) for t in context_ids[-max_n:]]
        if not tail or any(t < 0 or t >= self.vocab_size for t in tail):
            return None
        keys = suffix_keys(tail, self.width, len(tail))  # the store's keys, longest first
        found = [self.rows[key] for key in keys if key in self.rows]
        if not found:
            return None
        pick = 0 if self.rule == "longest" else choose(found, max_matches=self.options.max_matches)
        n, _, blob = found[pick]
        tree = decode_tree(blob, n=n, table=self.table).truncate(max_nodes)
        return tree if len(tree) else None

    @property
    def nbytes(self) -> int:
        """Return the estimated on-disk bytes of these rows published (heap, hash index, key filter)."""
        if not self.rows:
            return 0
        n = np.fromiter((r[0] for r in self.rows.values()), dtype=np.int64, count=len(self.rows))
        blob = np.fromiter((len(r[2]) for r in self.rows.values()), dtype=np.int64, count=len(self.rows))
        return int(estimate_row_bytes(n * self.width, blob).sum() + hash_index_bytes(len(self.rows)))
