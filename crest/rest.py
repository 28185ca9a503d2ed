"""The REST baseline: an in-memory suffix array over a tokenized corpus, and its drafter.

As in REST, documents are concatenated into one token array and suffixes are sorted; matching looks for
the longest context suffix from 16 tokens down to 2, takes up to 5000 matches, their continuations of 10
tokens, and prunes the trie of continuations to 64 nodes. REST never needs more than the first 16 tokens
of a suffix, so the array is sorted by those only (prefix doubling with numpy sorts: four rounds), and, a
departure from REST that keeps the comparison fair, no match or continuation crosses a document end.
`nbytes` is the size REST keeps on disk: the int32 token array plus the int32 (or int64) suffix array.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from crest_client.draft import Draft

from crest.drafters import build_draft
from crest.errors import ConfigError


def _doc_end(doc_offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return doc_offsets[np.searchsorted(doc_offsets, positions, side="right")]


def _dense_rank(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    new = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]
    rank = np.empty(keys.shape[0], dtype=np.int64)
    rank[order] = np.cumsum(new)  # ranks start at 1: 0 means "past the document end"
    return rank, order


class RestIndex:
    """Tokens, document offsets and the suffix array sorted by each suffix's first `max_suffix` tokens."""

    def __init__(self, tokens: np.ndarray, doc_offsets: np.ndarray, sa: np.ndarray, *, max_suffix: int = 16) -> None:
        self.tokens = tokens
        self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        self.sa = sa
        self.max_suffix = max_suffix

    @classmethod
    def build(cls, tokens: np.ndarray, doc_offsets: np.ndarray, *, max_suffix: int = 16) -> RestIndex:
        """Sort all suffixes by their first `max_suffix` tokens (within their document)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        offsets = np.asarray(doc_offsets, dtype=np.int64)
        size = tokens.shape[0]
        positions = np.arange(size, dtype=np.int64)
        end = _doc_end(offsets, positions)  # [N] end of each position's document
        rank, order = _dense_rank(tokens.astype(np.int64))
        span = 1
        while span < max_suffix and size:
            nxt = np.zeros(size, dtype=np.int64)
            inside = positions + span < end
            nxt[inside] = rank[positions[inside] + span]
            bits = int(rank.max()).bit_length()
            rank, order = _dense_rank((rank << bits) | nxt)
            span *= 2
        dtype = np.int32 if size < 2**31 else np.int64
        return cls(tokens, offsets, order.astype(dtype), max_suffix=max_suffix)

    @property
    def nbytes(self) -> int:
        """Return the bytes of the token array plus the suffix array."""
        return int(self.tokens.nbytes + self.sa.nbytes)

    def save(self, path: Path | str) -> None:
        """Write the index into directory `path`."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "tokens.npy", self.tokens)
        np.save(out / "doc_offsets.npy", self.doc_offsets)
        np.save(out / "sa.npy", self.sa)
        (out / "meta.json").write_text(json.dumps({"max_suffix": self.max_suffix, "format": 1}))

    @classmethod
    def load(cls, path: Path | str) -> RestIndex:
        """Memory-map an index written by `save`."""
        src = Path(path)
        try:
            meta = json.loads((src / "meta.json").read_text())
            return cls(
                np.load(src / "tokens.npy", mmap_mode="r"),
                np.load(src / "doc_offsets.npy"),
                np.load(src / "sa.npy", mmap_mode="r"),
                max_suffix=int(meta["max_suffix"]),
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{str(src)!r} is not a REST index directory: {exc}") from None

    def match_range(self, pattern: Sequence[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """Return the suffix-array range [lo, hi) of suffixes starting with `pattern` (within one document)."""
        hi = self.sa.shape[0] if hi is None else hi
        m = len(pattern)
        target = list(pattern)

        def prefix(i: int) -> list[int]:
            start = int(self.sa[i])
            stop = min(start + m, int(_doc_end(self.doc_offsets, np.array([start]))[0]))
            head = self.tokens[start:stop].tolist()
            return head + [-1] * (m - len(head))  # past the document end sorts first

        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            if prefix(mid) < target:
                a = mid + 1
            else:
                b = mid
        first, b = a, hi
        while a < b:
            mid = (a + b) // 2
            if prefix(mid) <= target:
                a = mid + 1
            else:
                b = mid
        return first, a


class RestDrafter:
    """REST's drafting: longest context suffix (16 down to 2), up to 5000 matches, continuations of 10."""

    def __init__(
        self,
        index: RestIndex,
        *,
        max_suffix: int = 16,
        min_suffix: int = 2,
        max_matches: int = 5000,
        continuation_length: int = 10,
        tree_size: int = 64,
    ) -> None:
        self.index = index
        self.max_suffix = min(max_suffix, index.max_suffix)
        self.min_suffix = min_suffix
        self.max_matches = max_matches
        self.length = continuation_length
        self.tree_size = tree_size

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        ctx = [int(t) for t in context_ids[-self.max_suffix :]]
        for m in range(len(ctx), self.min_suffix - 1, -1):  # the longest suffix with a match wins
            lo, hi = self.index.match_range(ctx[-m:])
            if lo < hi:
                break
        else:
            return None
        starts = np.asarray(self.index.sa[lo : min(hi, lo + self.max_matches)], dtype=np.int64) + m
        ends = np.minimum(starts + self.length, _doc_end(self.index.doc_offsets, starts - 1))
        tokens = self.index.tokens
        conts = [tokens[s:e].tolist() for s, e in zip(starts.tolist(), ends.tolist(), strict=True) if e > s]
        return build_draft(conts, tree_size=min(max_nodes, self.tree_size), n=m)
