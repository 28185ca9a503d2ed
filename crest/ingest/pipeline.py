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
from crest_client.codec import TokenTable, token_width
from crest_client.embedded import crest_home

from crest import db
from crest.config import IngestOptions, check_store_name, fault_pause, resolve_model_spec
from crest.errors import ConfigError, CorpusError
from crest.ingest.corpus import CorpusReport, iter_documents
from crest.ingest.loader import Reporter, RowLoader, RowReuse, SilentReporter
from crest.ingest.ngrams import count_ngrams
from crest.ingest.tokenizer import Tokenizer, load_tokenizer, tokenize_corpus

# Corpus positions scanned at once when counting and finding occurrences (occurrences gathered at once: 4x, trie
# batches: 1/4): peak memory follows this and the number of distinct n-grams, not the corpus size
# (`--chunk-tokens`, CREST_CHUNK_TOKENS).
CHUNK_TOKENS = 1 << 22


class Reuse(RowReuse, Protocol):
    """Supplies rows of a previous version that need no rebuilding, and records how the version was built."""

    def record(self, build: db.Build, summary: IngestSummary) -> None:
        """Record in the build's params how it was built (before it is published)."""
        ...


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
        loader = RowLoader(build, vocabulary.size, options, chunk_tokens=chunk_tokens, min_count=min_count)
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
