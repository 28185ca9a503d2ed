"""The recent tier: responses a store served lately, held in memory and matched at any depth, draftable at once.

A `RecentIndex` holds the last `capacity` learned tokens of one store (each learned row a document: its prompt's
tail, then its output) and answers "where did the context's suffix occur before, and what followed" in tens of
microseconds, so a response served a moment ago drafts the next request's step, on this replica as soon as the
learner is handed it and on every other replica as soon as the learned log is polled (`crest.drafting.feed`).
Positions are found by a hash of the last `key` tokens at two key lengths (a short one that finds any match and
a long one that finds deep matches among many shallow ones), each an LSM pair: a sorted block searched by
bisection and an unsorted tail appended to by `add` (hash chains of ints: nothing the garbage collector walks) and
folded in by `compact` on a thread of its own, started by the add that fills it. The candidates' true match
depth is then measured backwards (up to `max_depth` tokens); the deepest ones' continuations, as long as the match
is deep (suffix decoding's rule: a deep match earns a long draft), make the tree. Thread-safe: one lock, held for
lookups and appends, never across a sort.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from crest_client.draft import Draft

from crest.drafters.trie import build_draft
from crest.errors import ConfigError

log = logging.getLogger(__name__)

_MIX = np.uint64(0x9E3779B97F4A7C15)  # the hash's multiplier (odd: a bijection per step)
_SEP = -1  # between documents: matches and continuations never cross it


@dataclass(frozen=True)
class RecentOptions:
    """How large the recent tier is and how it drafts."""

    capacity: int = 1 << 20  # tokens held (the oldest are evicted)
    keys: tuple[int, int] = (2, 8)  # the two key lengths a position is indexed under (short, deep)
    candidates: int = 64  # most recent positions of a key measured for depth
    max_depth: int = 64  # deepest match measured, in tokens
    matches: int = 8  # continuations of the deepest matches the tree is built from
    max_continuation: int = 32  # longest continuation drafted (a match of depth d drafts at most d + 2)

    def check(self) -> RecentOptions:
        """Return the options, or raise ConfigError for a value that cannot work."""
        short, deep = self.keys
        if not (1 <= short < deep <= self.max_depth) or self.capacity < 1024:
            raise ConfigError("the recent tier needs 1 <= short key < deep key <= max depth and capacity >= 1024")
        if min(self.candidates, self.matches, self.max_continuation) < 1:
            raise ConfigError("the recent tier needs candidates, matches and max continuation >= 1")
        return self


class _Tail:
    """Positions appended since the last fold, in order, each chained to the one before it under the same hash.

    Parallel lists of Python ints and a dict of ints, not a list per hash: the cyclic garbage collector tracks
    every list, and a tail of 65,536 lists made full collections (tens of milliseconds, in whatever step
    allocated) that appends and lookups paid for.
    """

    __slots__ = ("hashes", "positions", "before", "last")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.positions: list[int] = []  # ascending
        self.before: list[int] = []  # entry -> the previous entry under its hash (-1: none)
        self.last: dict[int, int] = {}  # hash -> its latest entry

    def __len__(self) -> int:
        return len(self.positions)

    def append(self, hashes: list[int], positions: list[int]) -> None:
        before, last = self.before, self.last
        get = last.get  # bound once: this loop runs for every token a finished request served
        for i, h in enumerate(hashes, len(self.positions)):
            before.append(get(h, -1))
            last[h] = i
        self.hashes.extend(hashes)
        self.positions.extend(positions)

    def newest(self, h: int, limit: int) -> list[int]:
        """Return up to `limit` positions under hash `h`, newest first."""
        found: list[int] = []
        i, before, positions = self.last.get(h, -1), self.before, self.positions
        while i >= 0 and len(found) < limit:
            found.append(positions[i])
            i = before[i]
        return found

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Return the (hash, position) pairs as arrays [N], positions ascending."""
        return np.array(self.hashes, dtype=np.uint64), np.array(self.positions, dtype=np.int64)


class _Level:
    """Positions by the hash of the `k` tokens ending there: a sorted block, and a tail of those appended since."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.sorted_h = np.zeros(0, dtype=np.uint64)
        self.sorted_p = np.zeros(0, dtype=np.int64)  # absolute positions, ascending within one hash
        self.tail = _Tail()  # positions appended since the last fold
        self.folding = _Tail()  # the tail being folded into the sorted block (older than `tail`)

    def append(self, hashes: np.ndarray, positions: np.ndarray) -> None:
        self.tail.append(hashes.tolist(), positions.tolist())

    def find(self, h: int, limit: int) -> np.ndarray:
        """Return the (at most `limit`) most recent positions indexed under hash `h`, ascending."""
        new = self.tail.newest(h, limit)
        if len(new) < limit:
            new += self.folding.newest(h, limit - len(new))
        key = np.uint64(h)
        lo = np.searchsorted(self.sorted_h, key, side="left")
        hi = np.searchsorted(self.sorted_h, key, side="right")
        old = self.sorted_p[max(lo, hi - (limit - len(new))) : hi]
        if not new:
            return old
        return np.concatenate([old, np.asarray(new[::-1], dtype=np.int64)])

    def start_fold(self) -> tuple[np.ndarray, np.ndarray, _Tail]:
        """Set the tail aside for folding (a fresh tail takes appends); return the sorted block and the set-aside
        tail (read outside the lock: nothing appends to it any more)."""
        self.folding, self.tail = self.tail, _Tail()
        return self.sorted_h, self.sorted_p, self.folding

    def restore(self) -> None:
        """Put a set-aside tail back in front of what was appended since (a fold that failed)."""
        tail, since = self.folding, self.tail
        tail.append(since.hashes, since.positions)
        self.tail, self.folding = tail, _Tail()


def _hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """Return the hash of every k tokens ending at positions k-1.. of `tokens` [N] (int64) as uint64 [N - k + 1]."""
    n = tokens.shape[0] - k + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):  # h = (((t0 * M) + t1) * M + t2) ...: order matters
            h = h * _MIX + t[j : j + n]
    return h


_MASK = (1 << 64) - 1


def _key_hash(tokens: list[int]) -> int:
    """Return `_hashes`' value for one key (`tokens`: its k tokens), in Python: a lookup hashes one key per level."""
    h, mix = 0, int(_MIX)
    for t in tokens:  # uint64 arithmetic: every step wraps modulo 2^64, as numpy's does
        h = (h * mix + ((t + 1) & _MASK)) & _MASK
    return h


class RecentIndex:
    """One store's recently served documents, matched at any depth (see the module docstring)."""

    def __init__(self, options: RecentOptions | None = None) -> None:
        self.options = (options or RecentOptions()).check()
        self._levels = [_Level(k) for k in self.options.keys]
        self._buffer = np.full(4096, _SEP, dtype=np.int64)  # tokens of positions base .. base + size - 1
        self._base = 0  # absolute position of buffer[0]
        self._size = 0
        self._lock = threading.Lock()
        self._folding = False  # a thread is folding the tails (under the lock: at most one at a time)
        self._documents = 0
        self._queued: deque[np.ndarray] = deque()  # documents `add_soon` was given, not yet added
        self._adding = threading.Lock()  # held while queued documents are added: by the writer, or a lookup
        self._inflight = False  # a queued document was taken and is being added
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._closed = False

    @property
    def documents(self) -> int:
        """Return how many documents were added (those `add_soon` was given included)."""
        self._settle()
        return self._documents

    @property
    def n_tokens(self) -> int:
        """Return how many tokens (separators included) the index holds."""
        self._settle()
        return self._size

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (a learned row: prompt tail, then output); draftable from the next lookup on."""
        doc = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if doc.shape[0] == 0:
            return
        fold = False
        with self._lock:
            start = self._base + self._size
            self._grow(doc.shape[0] + 1)
            at = self._size
            self._buffer[at : at + doc.shape[0]] = doc
            self._buffer[at + doc.shape[0]] = _SEP
            self._size += doc.shape[0] + 1
            for level in self._levels:
                hashes = _hashes(doc, level.k)
                level.append(hashes, start + level.k - 1 + np.arange(hashes.shape[0], dtype=np.int64))
            self._documents += 1
            fold = any(len(level.tail) > max(65_536, level.sorted_h.shape[0] // 2) for level in self._levels)
        if fold:  # the sort takes tens of milliseconds at a million tokens: never on the caller's step
            threading.Thread(target=self._fold_quietly, name="crest-recent-fold", daemon=True).start()

    def add_soon(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Queue one document for `add` on the index's writer thread and return at once.

        The writer adds it while the engine runs its forward (a few hundred microseconds a request, off the step);
        a lookup that comes first adds what is still queued before it searches, so a document is draftable from
        the next lookup on, as after `add`.
        """
        doc = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if doc.shape[0] == 0:
            return
        self._queued.append(doc)
        if self._closed:
            self._add_queued()
            return
        if self._writer is None:
            with self._adding:
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write, name="crest-recent-writer", daemon=True)
                    self._writer.start()
        self._wake.set()

    def close(self) -> None:
        """Add what is still queued and stop the writer thread (later `add_soon` calls add at once)."""
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(timeout=10)
        self._add_queued()

    def _write(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                self._add_queued()
            except Exception as exc:  # a document that cannot be added costs its drafts only
                log.warning("the recent tier could not add a document: %s: %s", type(exc).__name__, exc)

    def _add_queued(self) -> None:
        """Add the queued documents, in order (one thread at a time: a lookup waits for the writer's)."""
        with self._adding:
            while self._queued:
                self._inflight = True  # before the pop: a lookup that finds the queue empty then sees this
                try:
                    self.add(self._queued.popleft())
                finally:
                    self._inflight = False

    def _settle(self) -> None:
        """Add what `add_soon` still holds before a lookup (nothing to do, the usual case, costs two reads)."""
        if self._queued or self._inflight:
            self._add_queued()

    def compact(self) -> None:
        """Fold the appended tails into the sorted blocks and evict what lies beyond the capacity."""
        with self._lock:
            if self._folding:
                return  # another thread folds (its tails may have been empty: a flag, not the tails, says so)
            self._folding = True
            cutoff = self._base + max(0, self._size - self.options.capacity)
            taken = [level.start_fold() for level in self._levels]
        merged = []
        try:
            for sh, sp, tail in taken:  # the sort runs outside the lock: lookups and appends go on
                th, tp = tail.pairs()
                h, p = np.concatenate([sh, th]), np.concatenate([sp, tp])
                keep = p >= cutoff
                h, p = h[keep], p[keep]
                order = np.argsort(h, kind="stable")  # positions stay ascending within a hash: block, then tail
                merged.append((h[order], p[order]))
        except BaseException:
            with self._lock:  # nothing folded: the set-aside tails go back in front of what came since
                for level in self._levels:
                    level.restore()
                self._folding = False
            raise
        with self._lock:
            self._folding = False
            for level, (h, p) in zip(self._levels, merged, strict=True):
                level.sorted_h, level.sorted_p, level.folding = h, p, _Tail()
            drop = cutoff - self._base
            if drop > 0:
                self._buffer = self._buffer[drop:].copy()
                self._base, self._size = cutoff, self._size - drop

    def _fold_quietly(self) -> None:
        try:
            self.compact()
        except Exception as exc:  # the tails were put back: the next add's fold tries again
            log.warning("the recent tier could not fold its appended tokens: %s: %s", type(exc).__name__, exc)

    def draft(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int) -> Draft | None:
        """Return the tree of what followed the deepest earlier matches of the context's suffix, or None."""
        return self.follow(context_ids, max_nodes)[0]

    def follow(self, context_ids: Sequence[int] | np.ndarray, max_nodes: int) -> tuple[Draft | None, int]:
        """Return `draft`'s tree and, when it is one continuation, the absolute position of the token that follows
        its last node in the index (`tokens_from` reads on from there), else -1."""
        opts = self.options
        if max_nodes <= 0 or len(context_ids) < opts.keys[0]:
            return None, -1
        tail = np.asarray(context_ids[-opts.max_depth :], dtype=np.int64).reshape(-1)
        self._settle()
        with self._lock:
            if not self._size:
                return None, -1
            found = self._candidates(tail)
            if found is None:
                return None, -1
            depth, positions = found
            length = min(opts.max_continuation, depth + 2)
            at = positions[:, None] - self._base + 1 + np.arange(length)  # [M, L] buffer indexes
            rows = np.where(at < self._size, self._buffer[np.minimum(at, self._size - 1)], _SEP)
        if rows.shape[0] == 1 or (rows == rows[0]).all():  # one continuation (the usual case): a chain
            chain = _chain(rows[0][:max_nodes], depth, weight=rows.shape[0])
            return chain, (int(positions[0]) + 1 + len(chain) if chain is not None else -1)
        tree = build_draft(rows, tree_size=max_nodes, n=depth)
        return (tree if len(tree) else None), -1

    def tokens_from(self, position: int, length: int) -> list[int]:
        """Return up to `length` tokens held from absolute `position` on, within their document (none once evicted)."""
        self._settle()
        with self._lock:
            at = position - self._base
            if at < 0 or at >= self._size or length <= 0:
                return []
            held = self._buffer[at : min(self._size, at + length)].tolist()
        end = held.index(_SEP) if _SEP in held else len(held)
        return held[:end]

    def _candidates(self, tail: np.ndarray) -> tuple[int, np.ndarray] | None:
        """Return the deepest match depth and the most recent positions (absolute, at most `matches`) matching it."""
        opts = self.options
        last = tail[-max(level.k for level in self._levels) :].tolist()
        for level in reversed(self._levels):  # the deep key first: it finds deep matches among many shallow ones
            if tail.shape[0] < level.k:
                continue
            positions = level.find(_key_hash(last[-level.k :]), opts.candidates)
            positions = positions[positions >= self._base]
            if not positions.shape[0]:
                continue
            d = tail.shape[0]
            back = positions[:, None] - self._base - np.arange(d)  # [C, D] buffer indexes, backwards
            same = (back >= 0) & (self._buffer[np.maximum(back, 0)] == tail[::-1][None, :])
            depths = np.where(same.all(axis=1), d, np.argmin(same, axis=1))  # tokens matched backwards
            best = int(depths.max())
            if best < level.k:  # only hash collisions
                continue
            chosen = positions[depths == best][-opts.matches :][::-1]  # most recent first
            return best, chosen
        return None

    def _grow(self, extra: int) -> None:
        need = self._size + extra
        if need > self._buffer.shape[0]:
            grown = np.full(max(need, 2 * self._buffer.shape[0]), _SEP, dtype=np.int64)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown


def _chain(row: np.ndarray, n: int, *, weight: int) -> Draft | None:
    """Return the chain of `row`'s tokens before its first separator, each node of weight `weight`."""
    ends = np.flatnonzero(row < 0)
    tokens = row[: int(ends[0])] if ends.shape[0] else row
    if not tokens.shape[0]:
        return None
    k = tokens.shape[0]
    return Draft(tokens.copy(), np.arange(-1, k - 1, dtype=np.int32), np.full(k, weight, dtype=np.int64), n)


class RecentDrafter:
    """A drafter over a shared `RecentIndex` (the part named "recent")."""

    def __init__(self, index: RecentIndex) -> None:
        self.index = index

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the recent tier's tree for the context, or None."""
        return self.index.draft(context_ids, max_nodes)

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return the one part behind this drafter's tree: the recent tier."""
        return {"recent": tree} if tree is not None and len(tree) else {}
