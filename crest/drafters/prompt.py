"""Prompt lookup decoding: drafts from the request's own text, after earlier occurrences of the context's suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from crest_client.draft import Draft

from crest.drafters.trie import build_draft
from crest.errors import ConfigError

_FEW = 64  # occurrences of the last token up to which the match is extended in Python


class PromptDrafter:
    """Prompt lookup: continuations after the most recent earlier occurrences of the context's longest suffix.

    The longest suffix of n tokens (`max_ngram` down to `min_ngram`) that also ends earlier in the context
    wins; the `continuation_length` tokens after each of its `max_matches` most recent occurrences form a
    tree whose weights count the occurrences through each node. The context is kept in a growing buffer
    reused while each call's context extends the previous one (the verifier's case), so a step costs one
    lookup of the last token's earlier occurrences (indexed as the context grows) plus work on them. Not
    thread-safe.
    """

    def __init__(
        self, *, max_ngram: int = 8, min_ngram: int = 2, max_matches: int = 8, continuation_length: int = 10
    ) -> None:
        if not 1 <= min_ngram <= max_ngram or max_matches < 1 or continuation_length < 1:
            raise ConfigError("prompt lookup needs 1 <= min_ngram <= max_ngram, max_matches and length >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_matches, self.continuation_length = max_matches, continuation_length
        self._seen: list[int] = []
        self._where: dict[int, list[int]] = {}  # token -> its positions in the context, ascending
        self._buffer = np.zeros(1024, dtype=np.int64)
        self._last: tuple[int, int, list[int]] = (-1, 0, [])  # (context length, match length, continuation starts)

    def draft(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int) -> Draft | None:
        """Return the tree of continuations after the longest repeated suffix, or None."""
        ctx = self._sync(context_ids)  # [N]
        size = ctx.shape[0]
        top = min(self.max_ngram, size - 1)
        if top < self.min_ngram or max_nodes <= 0:
            return None
        found = self._where[self._seen[-1]]
        if len(found) <= _FEW:  # a rare last token: Python over its few earlier ends beats numpy calls
            hits, best = self._extend_few(found[:-1], top)
        else:
            hits, best = self._extend_many(ctx, top)
        if best < self.min_ngram or not hits:
            return None
        seen, width = self._seen, self.continuation_length
        starts = [h + 1 for h in hits[::-1][: self.max_matches]]  # most recent first
        self._last = (size, best, starts)
        rows = [seen[s : s + width] + [-1] * max(0, s + width - size) for s in starts]  # [M, L], -1 past the end
        tree = build_draft(np.array(rows, dtype=np.int64), tree_size=max_nodes, n=best)
        return tree if len(tree) else None

    def _extend_few(self, hits: list[int], top: int) -> tuple[list[int], int]:
        """Return the earlier ends of the longest suffix of at most `top` tokens that recurs, and its length."""
        seen, size, best = self._seen, len(self._seen), 1
        for k in range(1, top):  # extend the match backwards while some occurrence keeps up
            want = seen[size - 1 - k]
            longer = [h for h in hits if h >= k and seen[h - k] == want]
            if not longer:
                break
            hits, best = longer, k + 1
        return hits, best

    def _extend_many(self, ctx: np.ndarray, top: int) -> tuple[list[int], int]:
        """`_extend_few` with numpy, for a last token that occurred often."""
        size = ctx.shape[0]
        hits = np.flatnonzero(ctx[: size - 1] == ctx[size - 1])  # earlier ends of the last token
        best = 1
        for k in range(1, top):
            back = hits - k
            longer = hits[(back >= 0) & (ctx[np.maximum(back, 0)] == ctx[size - 1 - k])]
            if not longer.shape[0]:
                break
            hits, best = longer, k + 1
        return hits.tolist(), best

    def source_at(self, chain: list[int], *, context_length: int) -> int:
        """Return where the context goes on after `chain` (an absolute position) when the last draft, for a context
        of this length, matched the longest suffix it looks for (`max_ngram` tokens) and one of its occurrences went
        on with exactly `chain`; else -1. A chain copied from the context can be read on there (`ChainStream`)."""
        length, best, starts = self._last
        if length != context_length or best < self.max_ngram or not chain:
            return -1
        seen, k = self._seen, len(chain)
        for start in starts:  # most recent first
            if start + k < len(seen) and seen[start : start + k] == chain:
                return start + k
        return -1

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return the one part behind this drafter's tree: the prompt."""
        return {"prompt": tree} if tree is not None and len(tree) else {}

    def _sync(self, context_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Return the context as an int64 array, reusing the buffer when it extends the last context."""
        ids = context_ids if isinstance(context_ids, list) else np.asarray(context_ids).reshape(-1).tolist()
        known = len(self._seen)
        if len(ids) < known or ids[:known] != self._seen:
            self._seen, self._where, known = [], {}, 0
        fresh = [int(t) for t in ids[known:]]
        if fresh:
            need = known + len(fresh)
            if need > self._buffer.shape[0]:
                grown = np.zeros(max(need, 2 * self._buffer.shape[0]), dtype=np.int64)
                grown[:known] = self._buffer[:known]
                self._buffer = grown
            self._buffer[known:need] = fresh
            self._seen.extend(fresh)
            for at, token in enumerate(fresh, start=known):
                self._where.setdefault(token, []).append(at)
        return self._buffer[: len(self._seen)]
