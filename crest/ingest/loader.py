"""Loading a build's rows: trees for the selected n-grams, encoded and streamed into the build's table.

`RowLoader` takes the n-gram counts of a token array, selects what to keep (a fixed top-t, the largest t within a
byte budget, or by expected savings through `crest.ingest.selection`), builds the trees in batches, encodes them
against one token table and copies the rows into the build, accounting kept n-grams, nodes, bytes and the key
filter as it goes; rows a `RowReuse` supplies (the live tier's incremental refresh) are copied instead of built.
Budgets count what the version reports on disk (`crest.ingest.disk`): rows, their hash index and fixed parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from crest_client.choice import promise
from crest_client.codec import TokenTable, encode_tree, token_width
from crest_client.keyfilter import KeyFilter, hash_keys

from crest import db
from crest.config import IngestOptions, fault_pause
from crest.ingest.disk import estimate_row_bytes, fit_count, fixed_bytes, rank_blocks
from crest.ingest.ngrams import Selected, lengths_for, select_top
from crest.ingest.pruned_budget import PrunedBytes
from crest.ingest.selection import load_savings
from crest.ingest.trees import TreeBatch, build_trees

Advance = Callable[[int], None]


class Reporter(Protocol):
    """Receives progress: `stage(name, total)` returns a callable taking the amount advanced."""

    def stage(self, name: str, total: int | None) -> Advance: ...

    def done(self, name: str) -> None: ...


class SilentReporter:
    """A reporter that shows nothing."""

    def stage(self, name: str, total: int | None) -> Advance:
        return lambda advance: None

    def done(self, name: str) -> None:
        pass


class RowReuse(Protocol):
    """Supplies rows of a previous version that need no rebuilding (the live tier's incremental refresh)."""

    def copy(self, build: db.Build, n: int, ngrams: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Copy the rows it can into the build; return (mask [K] of the n-grams copied, their nodes, blob bytes)."""
        ...


class RowSink(Protocol):
    """Takes the loaded rows: a build's table (`db.Build`), or memory (`--suffix-rule auto`'s trial build)."""

    def copy_ngrams(self, rows: Iterable[tuple[bytes, int, int, bytes]]) -> int: ...


class RowLoader:
    """Builds trees for the selected n-grams, encodes them and streams rows into the build's table."""

    def __init__(
        self,
        build: db.Build | RowSink,
        vocab_size: int,
        options: IngestOptions,
        *,
        chunk_tokens: int,
        min_count: int = 1,
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.min_count = min_count
        self.build = build
        self.vocab_size = vocab_size
        self.options = options
        self.table = TokenTable(np.zeros(0, dtype=np.int64))
        self.keys: dict[int, list[bytes]] = {n: [] for n in range(1, options.max_n + 1)}
        self.width = token_width(vocab_size)
        self.kept: dict[int, int] = {n: 0 for n in range(1, options.max_n + 1)}
        self.covered: dict[int, int] = {n: 0 for n in range(1, options.max_n + 1)}
        self.nodes = 0
        self.blob_bytes = 0
        self.fixed_table: TokenTable | None = None
        self.reuse: RowReuse | None = None

    def load(self, tokens: np.ndarray, offsets: np.ndarray, counts: Any, rep: Reporter) -> int | None:
        """Load the selection (fixed T) or the largest T within the budget; return T."""
        opts = self.options
        unigram = np.zeros(self.vocab_size, dtype=np.int64)  # blobs store tokens by corpus frequency rank
        unigram[counts.ngrams(1)[:, 0]] = counts.counts[1]
        self.table = TokenTable.from_counts(unigram) if self.fixed_table is None else self.fixed_table
        if opts.keep != "count":  # by expected saved tokens: crest.ingest.selection
            return load_savings(self, tokens, offsets, counts, rep, row_bytes=self.row_bytes)
        if opts.budget is None:
            assert opts.top_t is not None
            selected = self.frequent(select_top(counts, top_t=opts.top_t, mode=opts.selection, n=opts.single_n))
            total = sum(len(s.counts) for s in selected.values())
            advance = rep.stage("build trees + load", total)
            for n, sel in selected.items():
                sel = self._reused(n, sel, advance)
                rows = self._rows(tokens, offsets, n, sel.ngrams, sel.counts, advance)
                self.build.copy_ngrams(rows)
            return opts.top_t
        return self._load_budget(tokens, offsets, counts, rep)

    def frequent(self, selected: dict[int, Selected]) -> dict[int, Selected]:
        """Return the selection without the n-grams seen fewer than `min_count` times (most common first)."""
        if self.min_count <= 1:
            return selected
        out = {}
        for n, sel in selected.items():
            keep = int(np.count_nonzero(sel.counts >= self.min_count))  # counts are sorted descending
            out[n] = Selected(sel.ngrams[:keep], sel.counts[:keep], sel.keys[:keep])
        return out

    def _reused(self, n: int, sel: Selected, advance: Advance) -> Selected:
        """Copy the rows `reuse` supplies (accounted like built ones) and return the rest of the selection."""
        if self.reuse is None or len(sel.counts) == 0:
            return sel
        assert isinstance(self.build, db.Build)  # rows are reused into a version's table only
        done, nodes, blob_bytes = self.reuse.copy(self.build, n, sel.ngrams, sel.counts)
        raw = np.ascontiguousarray(sel.ngrams[done], dtype=np.int64).astype(f">u{self.width}").tobytes()
        stride = n * self.width
        self.keys[n].extend(raw[i : i + stride] for i in range(0, len(raw), stride))
        self.kept[n] += int(done.sum())
        self.covered[n] += int(sel.counts[done].sum())
        self.nodes += nodes
        self.blob_bytes += blob_bytes
        advance(int(done.sum()))
        return Selected(sel.ngrams[~done], sel.counts[~done], sel.keys[~done])

    def _rows(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        n: int,
        ngrams: np.ndarray,
        counts: np.ndarray,
        advance: Advance,
    ) -> Iterator[tuple[bytes, int, int, bytes]]:
        yield from self.account(n, self.encoded(tokens, offsets, n, ngrams, counts), advance)

    def encoded(
        self, tokens: np.ndarray, offsets: np.ndarray, n: int, ngrams: np.ndarray, counts: np.ndarray
    ) -> Iterator[tuple[int, bytes, int, bytes, int]]:
        """Yield (index, key, count, blob, nodes) for the given n-grams that have a tree."""
        opts = self.options
        keys = np.ascontiguousarray(ngrams, dtype=np.int64).astype(f">u{self.width}")
        raw = keys.tobytes()
        stride = n * self.width
        batches: Iterator[TreeBatch] = build_trees(
            tokens,
            offsets,
            ngrams,
            n=n,
            vocab_size=self.vocab_size,
            counts=counts,  # known counts spare a scan of the corpus per call
            continuation_length=opts.continuation_length,
            max_matches=opts.max_matches,
            tree_size=opts.tree_size,
            seed=opts.seed,
            chunk_tokens=self.chunk_tokens,
            scan_occurrences=4 * self.chunk_tokens,  # the defaults' ratios: one knob bounds every stage
            batch_occurrences=max(1, self.chunk_tokens // 4),
        )
        vocab = self.vocab_size
        for batch in batches:
            off = batch.offsets
            for j, idx in enumerate(batch.ngram_index.tolist()):
                a, b = int(off[j]), int(off[j + 1])
                if a == b:
                    continue  # an n-gram with no continuation drafts nothing
                blob = encode_tree(
                    batch.tokens[a:b],
                    batch.parents[a:b],
                    batch.weights[a:b],
                    vocab_size=vocab,
                    table=self.table if opts.blob_format == 2 else None,
                    version=opts.blob_format,
                )
                yield idx, raw[idx * stride : (idx + 1) * stride], int(counts[idx]), blob, b - a

    def key_filter(self) -> KeyFilter:
        """Return the filter of every key loaded."""
        dtype = f">u{self.width}"
        hashes = [
            hash_keys(np.frombuffer(b"".join(keys), dtype=dtype).astype(np.int64).reshape(-1, n))
            for n, keys in self.keys.items()
        ]
        return KeyFilter.build(np.concatenate(hashes) if hashes else np.zeros(0, np.uint64))

    def drop(self, dropped: Mapping[bytes, int]) -> None:
        """Forget rows deleted after loading (key -> count): their keys, kept n-grams and covered positions."""
        if not dropped:
            return
        for n, keys in self.keys.items():
            self.keys[n] = [k for k in keys if k not in dropped]
            self.kept[n] = len(self.keys[n])
        for key, count in dropped.items():
            self.covered[len(key) // self.width] -= count

    def row_bytes(self, n: int, blob_bytes: np.ndarray) -> np.ndarray:
        """Return the on-disk bytes of rows of length-n keys with blobs of these sizes."""
        return estimate_row_bytes(n * self.width, blob_bytes)

    def _load_budget(self, tokens: np.ndarray, offsets: np.ndarray, counts: Any, rep: Reporter) -> int:
        """Load rank blocks until the next rank no longer fits the budget; return the T reached."""
        opts = self.options
        assert opts.budget is not None
        ns = lengths_for(counts.keys, mode=opts.selection, n=opts.single_n)
        ceiling = max(int(counts.unique(n)) for n in ns)
        full = self.frequent(select_top(counts, top_t=ceiling, mode=opts.selection, n=opts.single_n))
        advance = rep.stage("build trees + load (budget)", None)
        pruned = PrunedBytes(self.width) if opts.suffix_rule == "prune" else None  # fill it with the rows kept
        spent, spent_rows = 0, 0
        for lo, hi in rank_blocks(ceiling):
            per_n: dict[int, list[tuple[int, bytes, int, bytes, int]]] = {}
            rank_bytes = np.zeros(hi - lo, dtype=np.int64)
            rank_rows = np.zeros(hi - lo, dtype=np.int64)
            meta: dict[str, list[Any]] = {"keys": [], "ranks": [], "promises": [], "sizes": []}  # PrunedBytes.block's
            for n, sel in full.items():
                part = sel.ngrams[lo:hi]
                if len(part) == 0:
                    continue
                rows = list(self.encoded(tokens, offsets, n, part, sel.counts[lo:hi]))
                per_n[n] = rows
                ranks = np.array([r[0] for r in rows], dtype=np.int64)
                sizes = estimate_row_bytes(n * self.width, np.array([len(r[3]) for r in rows], dtype=np.int64))
                np.add.at(rank_bytes, ranks, sizes)
                np.add.at(rank_rows, ranks, 1)
                if pruned is not None:
                    meta["keys"] += [r[1] for r in rows]
                    meta["ranks"] += (lo + ranks).tolist()
                    meta["promises"] += [promise(n, r[2], r[3], max_matches=opts.max_matches) for r in rows]
                    meta["sizes"] += sizes.tolist()
            if pruned is None:
                cum, cum_rows = spent + np.cumsum(rank_bytes), spent_rows + np.cumsum(rank_rows)
            else:
                cum, cum_rows = pruned.block(lo, hi, **meta)
            fit = fit_count(cum, cum_rows, budget=opts.budget, fixed=self.fixed_bytes())  # ranks lo..lo+fit-1 fit
            for n, rows in per_n.items():
                self.build.copy_ngrams(self.account(n, [r for r in rows if r[0] < fit], advance))
            if fit < hi - lo:
                return lo + fit
            if len(cum):
                spent, spent_rows = int(cum[-1]), int(cum_rows[-1])
        return ceiling

    def fixed_bytes(self) -> int:
        """Return the version's bytes that do not grow with its rows (its token table known)."""
        return fixed_bytes(len(self.table.to_bytes()))

    def account(
        self, n: int, rows: Iterable[tuple[int, bytes, int, bytes, int]], advance: Advance
    ) -> Iterator[tuple[bytes, int, int, bytes]]:
        """Yield the rows to COPY (key, n, count, blob), accounting kept n-grams, nodes, bytes and keys."""
        for i, (_, key, count, blob, nodes) in enumerate(rows):
            self.keys[n].append(key)
            self.kept[n] += 1
            self.covered[n] += count
            self.nodes += nodes
            self.blob_bytes += len(blob)
            yield key, n, count, blob
            advance(1)
            if i == 0:
                fault_pause("load")  # the COPY is open and holds a row
