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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from crest_client.codec import TokenTable
from crest_client.embedded import crest_home

from crest import db
from crest.config import IngestOptions, fault_pause, resolve_model_spec
from crest.decoding.tokenizer import load_tokenizer
from crest.errors import CorpusError
from crest.ingest.corpus import CorpusReport, iter_documents
from crest.ingest.loader import Reporter, RowLoader, RowReuse, SilentReporter
from crest.ingest.ngrams import count_ngrams
from crest.ingest.novelty import novel_positions
from crest.ingest.publishing import (
    CHUNK_TOKENS,
    IngestSummary,
    Vocabulary,
    building,
    check_ingest,
    check_judge,
    prepared,
    publish_summary,
)
from crest.ingest.suffix_choice import (
    choose_at_ingest,
    judge_by,
    judge_documents,
    loading_options,
    made_before,
    sample_judge,
    tokenize_judge,
)
from crest.ingest.suffixes import Choose, resolve_build
from crest.ingest.tokenizer import tokenize_corpus

if TYPE_CHECKING:
    from crest.ingest.dense import DenseOptions  # imports torch: only a dense build loads it

__all__ = ["CHUNK_TOKENS", "IngestSummary", "Reuse", "Vocabulary", "build_store", "ingest", "publish_summary"]


class Reuse(RowReuse, Protocol):
    """Supplies rows of a previous version that need no rebuilding, and records how the version was built."""

    decided: set[bytes]  # keys of the rows it copied, whose trees the previous version's suffix rule decided

    def record(self, build: db.Build, summary: IngestSummary) -> None:
        """Record in the build's params how it was built (before it is published)."""
        ...


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
    dense: DenseOptions | None = None,
    judge: Sequence[str] = (),
) -> IngestSummary:
    """Build a new version of `store` from `inputs` and publish it atomically (with a dense part if `dense`).

    `judge` names documents (any format, detected) that `--suffix-rule auto` chooses its rule on.
    """
    options = check_ingest(options, store=store, engine="inprocess", chunk_tokens=chunk_tokens)
    check_judge(options, judged=bool(judge))
    rep = reporter or SilentReporter()
    tokenizer = resolve_model_spec(tokenizer)
    seconds: dict[str, float] = {}
    tok = load_tokenizer(tokenizer)
    with prepared(dsn), _workdir() as work:
        t0 = time.perf_counter()
        report = CorpusReport()
        docs = iter_documents(inputs, fmt=fmt, report=report)
        judge_docs = judge_documents(judge)  # resolved now: a missing path fails before the corpus is read
        fault_pause("read")
        corpus = tokenize_corpus(docs, tok, workdir=work, progress=rep.stage("read + tokenize", None))
        rep.done("read + tokenize")
        if corpus.tokens_total == 0:
            raise CorpusError("the corpus has no tokens: every document was empty")
        judged = tokenize_judge(judge_docs, tok, workdir=work / "judge")
        seconds["read_tokenize"] = time.perf_counter() - t0
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
            dense=dense,
            judge=judged,
        )
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
    dense: DenseOptions | None = None,
    before_publish: Callable[[db.Build], None] | None = None,
    judge: tuple[np.ndarray, np.ndarray] | None = None,
) -> IngestSummary:
    """Count, select (n-grams seen `min_count` times or more), build trees, load and publish a version of `store`.

    `token_table` replaces the ranking of the tokens by their count here; with a fixed top-t, `reuse` copies rows
    instead of building them; `before_publish` adds a part to the version (the live tier's dense entries); `judge`
    (tokens, offsets) is the text `--suffix-rule auto` chooses on instead of a held-out slice.
    """
    # tokens: [N] int32, offsets: [D + 1] int64, document d = tokens[offsets[d]:offsets[d + 1]]
    options = check_ingest(options, store=store, chunk_tokens=chunk_tokens)
    report = report or CorpusReport(documents=len(offsets) - 1)
    rep = reporter or SilentReporter()
    seconds = {} if seconds is None else seconds
    choose: Choose | None = None
    novel = None
    figures: dict[str, Any] | None = None
    if options.suffix_rule == "auto":  # the rule: on a trial build (held-out slice or `judge`), or on `judge` later
        t0 = time.perf_counter()
        judge = sample_judge(*judge, seed=options.seed) if judge is not None else None
        if judge is None or options.budget is not None:  # a budget's rows depend on the rule: choose first
            figures = choose_at_ingest(
                tokens,
                offsets,
                vocab_size=vocabulary.size,
                options=options,
                chunk_tokens=chunk_tokens,
                reporter=rep,
                min_count=min_count,
                judge=judge,
            )
            choose, judge = made_before(figures), None
        else:
            novel = novel_positions((tokens, offsets), judge, window=options.max_n, chunk_tokens=chunk_tokens)
        seconds["suffix_choice"] = time.perf_counter() - t0
    else:
        check_judge(options, judged=judge is not None)
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

    with building(dsn, store, vocabulary=vocabulary, options=options, params=params, tier=tier) as build:
        t0 = time.perf_counter()
        fault_pause("build")
        loading = loading_options(options, figures)  # auto under a budget: filled the chosen rule's way
        loader = RowLoader(build, vocabulary.size, loading, chunk_tokens=chunk_tokens, min_count=min_count)
        loader.fixed_table, loader.reuse = token_table, reuse
        top_t = loader.load(tokens, offsets, counts, rep)
        if judge is not None:
            choose = judge_by(judge, novel, options=options, table=loader.table, width=loader.width)
        resolved = resolve_build(  # the tree each row holds: crest.ingest.suffixes
            build,
            options=options,
            vocab_size=vocabulary.size,
            table=loader.table,
            width=loader.width,
            decided=reuse.decided if reuse is not None else (),
            choose=choose,
        )
        if resolved is not None:
            loader.nodes, loader.blob_bytes = resolved.nodes, resolved.blob_bytes
            loader.drop(resolved.dropped)  # the key filter and the figures count the rows left only
        build.write_store_data(loader.table.to_bytes(), loader.key_filter().to_bytes())
        rep.done("build trees + load")
        seconds["trees_load"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        build.finish_tables()
        if dense is not None:  # before publishing: the dense part is published and cleaned up with the version
            from crest.ingest.dense import build_dense

            t1 = time.perf_counter()
            build_dense(build, tokens, offsets, options=dense, fingerprint=vocabulary.fingerprint, reporter=rep)
            seconds["dense"] = time.perf_counter() - t1
            t0 += seconds["dense"]  # index_publish counts the n-gram part's indexing and the publication only
        if before_publish is not None:
            t1 = time.perf_counter()
            before_publish(build)
            seconds["dense"] = time.perf_counter() - t1
            t0 += seconds["dense"]
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
            suffix_choice=resolved.choice if resolved is not None else None,
        )
        if reuse is not None:
            reuse.record(build, summary)
        publish_summary(build, summary, seconds=seconds, started=t0, allow_empty=allow_empty)
    return summary
