"""The ingest pipeline: corpus -> token ids -> n-gram counts -> selection -> trees -> blobs -> COPY -> publish.

Each stage takes arrays and returns arrays; this module only sequences them, times them, reports progress
and guarantees the all-or-nothing outcome: the new version becomes visible in one transaction at the end,
and any failure (or a kill, cleaned up by the next run) leaves the previously published version untouched.
`ingest` reads and tokenizes a corpus and hands the token arrays to `build_store`, which counts, builds the
trees, loads and publishes them; the learning tier calls `build_store` on the tokens a store served.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from crest_client.codec import TokenTable, encode_tree, token_width
from crest_client.embedded import crest_home
from crest_client.keyfilter import KeyFilter, hash_keys

from crest import db
from crest.config import IngestOptions, check_store_name, fault_pause, resolve_model_spec
from crest.errors import ConfigError, CorpusError
from crest.ingest.corpus import CorpusReport, iter_documents
from crest.ingest.ngrams import Selected, count_ngrams, select_top
from crest.ingest.selection import load_savings
from crest.ingest.tokenizer import Tokenizer, load_tokenizer, tokenize_corpus
from crest.ingest.trees import TreeBatch, build_trees

Advance = Callable[[int], None]

# Corpus positions scanned at once when counting and finding occurrences (occurrences gathered at once: 4x, trie
# batches: 1/4): peak memory follows this and the number of distinct n-grams, not the corpus size
# (`--chunk-tokens`, CREST_CHUNK_TOKENS).
CHUNK_TOKENS = 1 << 22

# On-disk cost of a row besides its key and blob: heap tuple header (24), store_id (4), n (2), count (4),
# varlena headers, alignment, the line pointer (4) and a hash index entry (~20 at the default fill factor).
_HASH_ENTRY_BYTES = 22


class Reporter(Protocol):
    """Receives progress: `stage(name, total)` returns a callable taking the amount advanced."""

    def stage(self, name: str, total: int | None) -> Advance: ...

    def done(self, name: str) -> None: ...


class Reuse(Protocol):
    """Supplies rows of a previous version that need no rebuilding (the live tier's incremental refresh)."""

    def copy(self, build: db.Build, n: int, ngrams: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Copy the rows it can into the build; return (mask [K] of the n-grams copied, their nodes, blob bytes)."""
        ...

    def record(self, build: db.Build, summary: IngestSummary) -> None:
        """Record in the build's params how it was built (before it is published)."""
        ...


class SilentReporter:
    """A reporter that shows nothing."""

    def stage(self, name: str, total: int | None) -> Advance:
        return lambda advance: None

    def done(self, name: str) -> None:
        pass


@dataclass
class IngestSummary:
    """What an ingest did, printed by the CLI and recorded in the store's `figures`."""

    store: str
    store_id: int
    documents: int
    empty_documents: int
    dropped_records: int
    drop_reasons: list[str]
    tokens: int
    counted: dict[int, int]
    kept: dict[int, int]
    positions: dict[int, int]
    covered: dict[int, int]
    avg_tree_nodes: float
    blob_bytes: int
    table_bytes: int
    index_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    top_t: int | None = None

    @property
    def rows(self) -> int:
        return sum(self.kept.values())

    @property
    def bytes_per_ngram(self) -> float:
        return (self.table_bytes + self.index_bytes) / max(1, self.rows)

    def to_figures(self) -> dict[str, Any]:
        """Return the summary as JSON-ready figures."""
        out = asdict(self)
        for key in ("counted", "kept", "positions", "covered"):
            out[key] = {str(k): v for k, v in out[key].items()}
        out["bytes_per_ngram"] = round(self.bytes_per_ngram, 1)
        return out


def estimate_row_bytes(key_bytes: np.ndarray | int, blob_bytes: np.ndarray | int) -> np.ndarray:
    """Estimate the on-disk bytes of n-gram rows (heap tuple, line pointer, hash index entry)."""
    key = np.asarray(key_bytes, dtype=np.int64)
    blob = np.asarray(blob_bytes, dtype=np.int64)
    blob_hdr = np.where(blob + 1 <= 126, 1, 4)
    data = 4 + (key + 1) + 1 + 2 + 4 + 3 + blob_hdr + blob  # int4, key, pad, int2, int4 (aligned), blob
    heap = (24 + data + 7) // 8 * 8 + 4
    return heap + _HASH_ENTRY_BYTES + 2  # + the key filter's 10 bits


@contextmanager
def _workdir() -> Iterator[Path]:
    root = crest_home() / "work"
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_workdirs(root)
    path = Path(tempfile.mkdtemp(prefix=f"ingest-{os.getpid()}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_workdirs(root: Path) -> None:
    """Delete the work directories of ingests whose process is gone."""
    for child in root.glob("ingest-*"):
        try:
            pid = int(child.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except PermissionError:
            pass


@dataclass(frozen=True)
class Vocabulary:
    """What a version records of its tokenizer: where it loads from, its fingerprint, size and text pieces."""

    spec: str
    fingerprint: str
    size: int
    pieces: Callable[[], Iterable[tuple[int, str]]]  # (id, text), for SQL rendering

    @classmethod
    def of(cls, tok: Tokenizer, spec: str) -> Vocabulary:
        """Return the vocabulary of a loaded tokenizer (`spec`: the path or name it was loaded from)."""
        recorded = str(Path(spec).resolve()) if Path(spec).exists() else str(spec)
        return cls(recorded, tok.fingerprint, tok.vocab_size, tok.pieces)


def _peak_rss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def ingest(
    inputs: Sequence[str],
    *,
    store: str,
    tokenizer: str,
    dsn: str,
    options: IngestOptions,
    fmt: str = "auto",
    reporter: Reporter | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> IngestSummary:
    """Build a new version of `store` from `inputs` and publish it atomically."""
    options = options.validate().with_defaults()
    if chunk_tokens < 1:
        raise ConfigError(f"--chunk-tokens must be positive, got {chunk_tokens}")
    check_store_name(store)
    rep = reporter or SilentReporter()
    tokenizer = resolve_model_spec(tokenizer)
    seconds: dict[str, float] = {}
    tok = load_tokenizer(tokenizer)
    db.upgrade(dsn)
    with db.session(dsn) as conn:
        db.clean_leftovers(conn)

    with _workdir() as work:
        t0 = time.perf_counter()
        report = CorpusReport()
        docs = iter_documents(list(inputs), fmt=fmt, report=report)
        fault_pause("read")
        corpus = tokenize_corpus(docs, tok, workdir=work, progress=rep.stage("read + tokenize", None))
        rep.done("read + tokenize")
        seconds["read_tokenize"] = time.perf_counter() - t0
        if corpus.tokens_total == 0:
            raise CorpusError("the corpus has no tokens: every document was empty")
        summary = build_store(
            corpus.tokens,
            corpus.doc_offsets,
            store=store,
            dsn=dsn,
            vocabulary=Vocabulary.of(tok, tokenizer),
            options=options,
            params={"format": fmt},
            report=report,
            reporter=rep,
            chunk_tokens=chunk_tokens,
            seconds=seconds,
        )
    with db.session(dsn) as conn:
        db.clean_leftovers(conn)
    return summary


def build_store(
    tokens: np.ndarray,
    offsets: np.ndarray,
    *,
    store: str,
    dsn: str,
    vocabulary: Vocabulary,
    options: IngestOptions,
    tier: str = "static",
    params: dict[str, Any] | None = None,
    min_count: int = 1,
    allow_empty: bool = False,
    report: CorpusReport | None = None,
    reporter: Reporter | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    seconds: dict[str, float] | None = None,
    token_table: TokenTable | None = None,
    reuse: Reuse | None = None,
) -> IngestSummary:
    """Count, select (n-grams seen `min_count` times or more), build trees, load and publish a version of `store`.

    `token_table` replaces the ranking of the tokens by their count here; with a fixed top-t, `reuse` copies rows
    instead of building them.
    """
    # tokens: [N] int32, offsets: [D + 1] int64, document d = tokens[offsets[d]:offsets[d + 1]]
    options = options.validate().with_defaults()
    report = report or CorpusReport(documents=len(offsets) - 1)
    rep = reporter or SilentReporter()
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    fault_pause("count")
    counts = count_ngrams(
        tokens,
        offsets,
        max_n=options.max_n,
        vocab_size=vocabulary.size,
        progress=rep.stage("count n-grams", int(tokens.shape[0]) * options.max_n),
        chunk_tokens=chunk_tokens,
    )
    rep.done("count n-grams")
    seconds["count"] = time.perf_counter() - t0

    build = db.begin_build(
        dsn,
        store,
        fingerprint=vocabulary.fingerprint,
        tokenizer=vocabulary.spec,
        vocab_size=vocabulary.size,
        token_width=token_width(vocabulary.size),
        params={**asdict(options), **(params or {})},
        tier=tier,
    )
    try:
        t0 = time.perf_counter()
        build.copy_vocab(vocabulary.pieces())
        fault_pause("build")
        loader = _Loader(build, vocabulary.size, options, chunk_tokens=chunk_tokens, min_count=min_count)
        loader.fixed_table, loader.reuse = token_table, reuse
        top_t = loader.load(tokens, offsets, counts, rep)
        build.write_store_data(loader.table.to_bytes(), loader.key_filter().to_bytes())
        rep.done("build trees + load")
        seconds["trees_load"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        build.finish_tables()
        sizes = build.table_bytes()
        summary = IngestSummary(
            store=store,
            store_id=build.store_id,
            documents=report.documents,
            empty_documents=report.empty_documents,
            dropped_records=report.dropped_records,
            drop_reasons=list(report.drop_reasons),
            tokens=int(offsets[-1]) if len(offsets) else 0,
            counted={n: int(counts.unique(n)) for n in range(1, options.max_n + 1)},
            kept=loader.kept,
            positions={n: int(counts.positions(n)) for n in range(1, options.max_n + 1)},
            covered=loader.covered,
            avg_tree_nodes=loader.nodes / max(1, sum(loader.kept.values())),
            blob_bytes=loader.blob_bytes,
            table_bytes=sizes["table_bytes"],
            index_bytes=sizes["index_bytes"],
            seconds=seconds,
            top_t=top_t,
        )
        if reuse is not None:
            reuse.record(build, summary)
        publish_summary(build, summary, seconds=seconds, started=t0, allow_empty=allow_empty)
    except BaseException:
        build.fail()
        raise
    finally:
        build.close()
    return summary


def publish_summary(
    build: db.Build, summary: IngestSummary, *, seconds: dict[str, float], started: float, allow_empty: bool = False
) -> None:
    """Publish the build with the summary's figures (refusing an empty store), then record time and peak memory."""
    if summary.rows == 0 and not allow_empty:
        raise ConfigError("nothing to store: the budget is too small for even one n-gram per n")
    build.publish(summary.to_figures())
    seconds["index_publish"] = time.perf_counter() - started
    summary.peak_rss_bytes = _peak_rss()
    build.set_figures(summary.to_figures())


class _Loader:
    """Builds trees for the selected n-grams, encodes them and streams rows into the build's table."""

    def __init__(
        self, build: db.Build, vocab_size: int, options: IngestOptions, *, chunk_tokens: int, min_count: int = 1
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
        self.reuse: Reuse | None = None

    def load(self, tokens: np.ndarray, offsets: np.ndarray, counts: Any, rep: Reporter) -> int | None:
        """Load the selection (fixed T) or the largest T within the budget; return T."""
        opts = self.options
        unigram = np.zeros(self.vocab_size, dtype=np.int64)  # blobs store tokens by corpus frequency rank
        unigram[counts.ngrams(1)[:, 0]] = counts.counts[1]
        self.table = TokenTable.from_counts(unigram) if self.fixed_table is None else self.fixed_table
        if opts.keep != "count":  # by expected saved tokens: crest.ingest.selection
            return load_savings(self, tokens, offsets, counts, rep, row_bytes=self._row_bytes)
        if opts.budget is None:
            assert opts.top_t is not None
            selected = self._frequent(select_top(counts, top_t=opts.top_t, mode=opts.selection, n=opts.single_n))
            total = sum(len(s.counts) for s in selected.values())
            advance = rep.stage("build trees + load", total)
            for n, sel in selected.items():
                sel = self._reused(n, sel, advance)
                rows = self._rows(tokens, offsets, n, sel.ngrams, sel.counts, advance)
                self.build.copy_ngrams(rows)
            return opts.top_t
        return self._load_budget(tokens, offsets, counts, rep)

    def _frequent(self, selected: dict[int, Selected]) -> dict[int, Selected]:
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
        yield from self._account(n, self._encoded(tokens, offsets, n, ngrams, counts), advance)

    def _encoded(
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

    def _row_bytes(self, n: int, blob_bytes: np.ndarray) -> np.ndarray:
        return estimate_row_bytes(n * self.width, blob_bytes)

    def _load_budget(self, tokens: np.ndarray, offsets: np.ndarray, counts: Any, rep: Reporter) -> int:
        """Load rank blocks until the next rank no longer fits the budget; return the T reached."""
        opts = self.options
        assert opts.budget is not None
        ns = range(1, opts.max_n + 1) if opts.selection != "single" else [opts.single_n or 1]
        ceiling = max(int(counts.unique(n)) for n in ns)
        full = self._frequent(select_top(counts, top_t=ceiling, mode=opts.selection, n=opts.single_n))
        advance = rep.stage("build trees + load (budget)", None)
        spent, lo, block = 0, 0, 4096
        while lo < ceiling:
            hi = min(ceiling, lo + block)
            per_n: dict[int, list[tuple[int, bytes, int, bytes, int]]] = {}
            rank_bytes = np.zeros(hi - lo, dtype=np.int64)
            for n, sel in full.items():
                part = sel.ngrams[lo:hi]
                if len(part) == 0:
                    continue
                rows = list(self._encoded(tokens, offsets, n, part, sel.counts[lo:hi]))
                per_n[n] = rows
                ranks = np.array([r[0] for r in rows], dtype=np.int64)
                sizes = estimate_row_bytes(n * self.width, np.array([len(r[3]) for r in rows], dtype=np.int64))
                np.add.at(rank_bytes, ranks, sizes)
            cum = spent + np.cumsum(rank_bytes)
            fit = int(np.searchsorted(cum, opts.budget, side="right"))  # ranks lo..lo+fit-1 fit
            for n, rows in per_n.items():
                self.build.copy_ngrams(self._account(n, [r for r in rows if r[0] < fit], advance))
            if fit < hi - lo:
                return lo + fit
            spent = int(cum[-1]) if len(cum) else spent
            lo, block = hi, block * 2
        return ceiling

    def _account(
        self, n: int, rows: Iterable[tuple[int, bytes, int, bytes, int]], advance: Advance
    ) -> Iterator[tuple[bytes, int, int, bytes]]:
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
