"""Building a store on Apache Spark (`crest ingest --engine spark`): the same rows as the in-process engine.

The driver resolves the inputs, creates the build (`db.begin_build`), writes what is small (vocabulary, token
table, key filter, figures) and publishes atomically; everything that grows with the corpus runs on the
executors: reading and tokenizing (`spark_corpus`), counting n-grams per partition and merging them per key
range with `reduceByKey`, ranking them (count descending, key ascending, as `ngrams.rank`), sampling
occurrences by the smallest keyed hash of their global position (mergeable, as `trees.find_occurrences`),
building and encoding trees, and COPYing rows into the version's table over their own connections
(`spark_tasks`), and with `--suffix-rule prune` deleting the rows the `expected` rule never drafts from
(`spark_prune`); with `auto`, pruning or keeping every row as a judge corpus decides (`spark_choice`). The
driver holds only the selected keys of one rank block (to broadcast them) and one hash per stored row (for the
key filter). With `--budget`, ranks are loaded in doubling blocks until the next rank no longer fits, as
in-process. A failed or killed job fails the build: the published version stays.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from crest_client.codec import TokenTable, token_width
from crest_client.keyfilter import KeyFilter
from psycopg import sql

from crest import db, errors
from crest.config import IngestOptions, resolve_model_spec
from crest.decoding.tokenizer import load_tokenizer
from crest.errors import ConfigError, CorpusError, CrestError
from crest.ingest.corpus import input_list
from crest.ingest.loader import Reporter, SilentReporter
from crest.ingest.ngrams import unpack_keys
from crest.ingest.publishing import (
    CHUNK_TOKENS,
    IngestSummary,
    Vocabulary,
    building,
    check_ingest,
    check_judge,
    peak_rss,
    prepared,
    publish_summary,
)
from crest.ingest.spark_choice import choose_on_spark
from crest.ingest.spark_corpus import (
    corpus_report,
    number_documents,
    read_documents,
    resolve_sources,
    tokenize_partition,
)
from crest.ingest.spark_load import Loader, Plan
from crest.ingest.spark_prune import Pruned, prune_rows
from crest.ingest.spark_tasks import (
    LoadStats,
    bucket_bounds,
    bucket_count,
    count_histogram,
    local_counts,
    merge_counts,
    rank_offsets,
    ranks_of,
    spaced_sample,
    split_by_bounds,
)
from crest.ingest.suffix_choice import judge_documents, tokenize_judge

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import SparkSession

PARTITION_BYTES = 16 << 20  # corpus bytes per token partition when --spark-partitions is not given
_SAMPLE_KEYS = 1024  # keys each partition sends per n to place the key-range boundaries


@dataclass
class SparkIngestSummary(IngestSummary):
    """An ingest summary with the Spark job's figures (partitions, stage bytes, executor memory)."""

    spark: dict[str, Any] = field(default_factory=dict)


def check_spark() -> None:
    """Raise ConfigError unless pyspark can be imported and a Java runtime is found."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise ConfigError("the spark engine needs pyspark: pip install 'crest[spark]'") from None
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        raise ConfigError("the spark engine needs a Java runtime (17 or later): set JAVA_HOME or put java on PATH")


def spark_session(master: str | None = None, *, driver_memory: str = "4g") -> SparkSession:
    """Return the active Spark session, or start one on `master` (default `local[*]`).

    `driver_memory` sizes the JVM that, in local mode, is the executors too (Spark's default, 1g, is short).
    """
    check_spark()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # local workers run this interpreter
    builder = SparkSession.builder.appName("crest-ingest").master(master or "local[*]")
    builder = builder.config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
    builder = builder.config("spark.driver.memory", driver_memory)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def ingest_spark(
    inputs: Sequence[str],
    *,
    store: str,
    tokenizer: str,
    dsn: str,
    options: IngestOptions,
    fmt: str = "auto",
    master: str | None = None,
    partitions: int | None = None,
    spark: SparkSession | None = None,
    reporter: Reporter | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    judge: Sequence[str] = (),
) -> SparkIngestSummary:
    """Build a new version of `store` from `inputs` on Spark and publish it atomically.

    `judge` names documents (any format, detected) that `--suffix-rule auto` chooses its rule on (required here).
    """
    options = check_ingest(options, store=store, engine="spark", chunk_tokens=chunk_tokens, partitions=partitions)
    check_judge(options, judged=bool(judge), engine="spark")
    judge_docs = judge_documents(judge)  # resolved now: a missing path fails before any work
    owned = spark is None and (master is not None or not _has_active_session())
    session = spark or spark_session(master)
    try:
        spec = resolve_model_spec(tokenizer)
        tok = load_tokenizer(spec)
        vocabulary = Vocabulary.of(tok, spec)
        job = _Job(session, dsn=dsn, store=store, vocabulary=vocabulary, options=options, fmt=fmt)
        job.partitions = partitions or 0
        job.chunk_tokens, job.reporter = chunk_tokens, reporter or SilentReporter()
        with tempfile.TemporaryDirectory(prefix="crest-judge-") as work:
            job.judge = tokenize_judge(judge_docs, tok, workdir=Path(work))
        with prepared(dsn), spark_errors():
            summary = job.run([str(spec) for spec in input_list(inputs)])
    finally:
        if owned:
            session.stop()
    return summary


def _has_active_session() -> bool:
    check_spark()
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is not None


@contextmanager
def spark_errors() -> Iterator[None]:
    """Turn a failed Spark job into the crest error raised on the executor (one line), else a CrestError."""
    try:
        yield
    except CrestError:
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith(("py4j", "pyspark")):
            raise
        text = str(exc)
        if "java.lang.OutOfMemoryError" in text:
            raise CrestError(
                "the Spark job ran out of JVM memory: give Spark more (spark.driver.memory in local mode,"
                " spark.executor.memory on a cluster) or more --spark-partitions"
            ) from None
        for name, message in reversed(re.findall(r"crest\.errors\.(\w+): ([^\n]+)", text)):
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, CrestError):
                raise cls(message) from None
        lines = re.findall(r"^\w[\w.]*(?:Error|Exception): [^\n]+", text, flags=re.MULTILINE)
        raise CrestError(f"the Spark job failed: {(lines or text.splitlines() or ['?'])[-1][:500]}") from None


class _Job:
    """One Spark ingest: the stages in order, with the figures each adds."""

    def __init__(
        self, spark: SparkSession, *, dsn: str, store: str, vocabulary: Vocabulary, options: IngestOptions, fmt: str
    ) -> None:
        self.spark, self.sc = spark, spark.sparkContext
        self.dsn, self.store, self.vocabulary, self.options, self.fmt = dsn, store, vocabulary, options, fmt
        self.partitions, self.chunk_tokens = 0, CHUNK_TOKENS  # 0: from the corpus size
        self.reporter: Reporter = SilentReporter()
        self.width = token_width(vocabulary.size)
        self.seconds: dict[str, float] = {}
        self.tokens = 0
        self.figures: dict[str, Any] = {}
        self.stats: list[LoadStats] = []
        self.judge: tuple[np.ndarray, np.ndarray] | None = None  # `--suffix-judge`'s (tokens, offsets)
        self.choice: dict[str, Any] | None = None  # auto's choice: crest.ingest.suffix_choice.Choice's figures

    def run(self, inputs: list[str]) -> SparkIngestSummary:
        """Read, tokenize, count, then build, load and publish a version; fail the build on any error."""
        from pyspark import StorageLevel

        keep = StorageLevel.MEMORY_AND_DISK
        t0 = time.perf_counter()
        parts, report, bases = self._tokenize(inputs, keep)
        self.seconds["read_tokenize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ranked, counted, positions, unigram = self._count(parts, keep)
        self.seconds["count"] = time.perf_counter() - t0
        opts = self.options
        params = {"format": self.fmt}
        try:
            with building(self.dsn, self.store, vocabulary=self.vocabulary, options=opts, params=params) as build:
                t0 = time.perf_counter()
                table = TokenTable.from_counts(unigram)
                plan = Plan(
                    self.sc,
                    self.dsn,
                    opts,
                    self.vocabulary.size,
                    self.width,
                    self.partitions,
                    self.chunk_tokens,
                    self.reporter,
                    self.figures,
                )
                loader = Loader(plan, parts, ranked, build.store_id, bases, unigram, keep)
                top_t = loader.load_all(counted)
                pruned = Pruned()
                if self.judge is not None:  # --suffix-rule auto: prune, or keep every row (crest.ingest.spark_choice)
                    t1 = time.perf_counter()
                    self.choice = choose_on_spark(
                        parts,
                        self.judge,
                        sc=self.sc,
                        dsn=self.dsn,
                        store_id=build.store_id,
                        options=opts,
                        table=table,
                        width=self.width,
                        chunk_tokens=self.chunk_tokens,
                    )
                    self.seconds["suffix_choice"] = time.perf_counter() - t1
                if loader.records is not None:  # prune, or auto's choice of it: crest.ingest.spark_prune
                    sid, width, slices = build.store_id, self.width, self.partitions
                    if self.choice is None or self.choice["rule"] == "prune":
                        pruned = prune_rows(loader.records, dsn=self.dsn, store_id=sid, width=width, partitions=slices)
                    loader.records.unpersist()
                hashes = [s.hashes for s in loader.stats]
                filt = KeyFilter.build(pruned.left(np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)))
                build.write_store_data(table.to_bytes(), filt.to_bytes())
                markers = sql.SQL("DELETE FROM {} WHERE token_id < 0").format(db.vocab_table(build.store_id))
                with build.conn.transaction():  # the COPY tasks' markers
                    build.conn.execute(markers)
                self.seconds["trees_load"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                build.finish_tables()
                summary = self._summary(build, report, bases, counted, positions, loader, top_t, pruned)
                publish_summary(build, summary, seconds=self.seconds, started=t0)
        finally:
            parts.unpersist()
            ranked.unpersist()
        return summary

    def _tokenize(self, inputs: list[str], keep: Any) -> tuple[RDD[Any], Any, np.ndarray]:
        """Return the persisted token partitions, the corpus report and each partition's first global position."""
        rep = self.reporter
        advance = rep.stage("read + tokenize", None)
        sources = resolve_sources(self.spark, inputs, self.fmt)
        slices = self.partitions or self.sc.defaultParallelism
        items = read_documents(self.spark, sources, slices=slices).persist(keep)
        report = corpus_report(items)
        total = report.documents
        if total == 0:
            why = f": {report.drop_reasons[0]}" if report.drop_reasons else ""
            raise CorpusError(
                f"the corpus has no documents ({report.files} file(s) read, {report.empty_documents} empty "
                f"document(s), {report.dropped_records} record(s) dropped{why})"
            )
        if not self.partitions:  # about PARTITION_BYTES of text each: records stay small for the JVM
            self.partitions = max(self.sc.defaultParallelism, -(-report.bytes_read // PARTITION_BYTES))
        spread = number_documents(items, self.partitions, total)
        spec = self.vocabulary.spec
        parts = spread.mapPartitionsWithIndex(lambda i, docs: tokenize_partition(i, docs, spec)).persist(keep)
        sizes = dict(parts.map(lambda p: (p[0], (int(p[1].shape[0]), peak_rss()))).collect())
        items.unpersist()
        lengths = np.array([sizes.get(i, (0, 0))[0] for i in range(self.partitions)], dtype=np.int64)
        bases = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
        self.tokens = int(lengths.sum())
        self._worker_peak(max(v[1] for v in sizes.values()))
        advance(self.tokens)
        rep.done("read + tokenize")
        if self.tokens == 0:
            raise CorpusError("the corpus has no tokens: every document was empty")
        return parts, report, bases

    def _count(self, parts: RDD[Any], keep: Any) -> tuple[RDD[Any], dict[int, int], dict[int, int], np.ndarray]:
        """Count n-grams per partition, merge them per key range and rank them; return the ranked tables too."""
        opts, vocab, chunk = self.options, self.vocabulary.size, self.chunk_tokens
        advance = self.reporter.stage("count n-grams", None)
        local = parts.flatMap(
            lambda p: local_counts(p[1], p[2], max_n=opts.max_n, vocab_size=vocab, chunk_tokens=chunk)
        ).persist(keep)
        heads = local.map(lambda t: (t[0], spaced_sample(t[1], _SAMPLE_KEYS), t[3])).collect()
        positions = {n: sum(h[2] for h in heads if h[0] == n) for n in range(1, opts.max_n + 1)}
        buckets = 2 * self.partitions
        bounds = self.sc.broadcast({n: bucket_bounds([h[1] for h in heads if h[0] == n], buckets) for n in positions})
        merged = (
            local.flatMap(
                lambda t: [((t[0], b), table) for b, table in split_by_bounds(t[1], t[2], bounds.value[t[0]])]
            )
            .reduceByKey(merge_counts, numPartitions=self.partitions)
            .persist(keep)
        )
        hists = merged.map(lambda kv: (kv[0], count_histogram(kv[1][1]))).collect()
        local.unpersist()
        self.figures["count_shuffle_bytes"] = sum(int(v.sum()) for (_, _), (_, v) in hists) * 16
        offsets = {n: rank_offsets({b: h for (m, b), h in hists if m == n}) for n in positions}
        counted = {n: int(sum(h[1].sum() for (m, _), h in hists if m == n)) for n in positions}
        off = self.sc.broadcast(offsets)
        ranked = merged.map(lambda kv: (kv[0], (*kv[1], ranks_of(kv[1][1], off.value[kv[0][0]][kv[0][1]])))).persist(
            keep
        )
        ones = ranked.filter(lambda kv: kv[0][0] == 1).map(lambda kv: (kv[1][0], kv[1][1])).collect()
        merged.unpersist()
        unigram = np.zeros(vocab, dtype=np.int64)  # blobs store tokens by corpus frequency rank
        for keys, counts in ones:
            unigram[unpack_keys(keys, 1, vocab)[:, 0]] = counts
        self.figures["buckets"] = {n: bucket_count(bounds.value[n]) for n in positions}
        advance(self.tokens * opts.max_n)
        self.reporter.done("count n-grams")
        return ranked, counted, positions, unigram

    def _worker_peak(self, value: int) -> None:
        self.figures["worker_peak_rss_bytes"] = max(value, self.figures.get("worker_peak_rss_bytes", 0))

    def _summary(
        self,
        build: db.Build,
        report: Any,
        bases: np.ndarray,
        counted: dict[int, int],
        positions: dict[int, int],
        loader: Loader,
        top_t: int | None,
        pruned: Pruned,
    ) -> SparkIngestSummary:
        ns = range(1, self.options.max_n + 1)
        kept = {n: sum(s.kept.get(n, 0) for s in loader.stats) - pruned.kept.get(n, 0) for n in ns}
        covered = {n: sum(s.covered.get(n, 0) for s in loader.stats) - pruned.covered.get(n, 0) for n in ns}
        nodes = sum(s.nodes for s in loader.stats) - pruned.nodes
        self._worker_peak(max((s.peak_rss_bytes for s in loader.stats), default=0))
        sizes = build.table_bytes()
        spark = {"engine": "spark", "master": self.sc.master, "partitions": self.partitions, **self.figures}
        return SparkIngestSummary(
            store=self.store,
            store_id=build.store_id,
            documents=report.documents,
            empty_documents=report.empty_documents,
            dropped_records=report.dropped_records,
            drop_reasons=list(report.drop_reasons),
            tokens=self.tokens,
            counted=counted,
            kept=kept,
            positions=positions,
            covered=covered,
            avg_tree_nodes=nodes / max(1, sum(kept.values())),
            blob_bytes=sum(s.blob_bytes for s in loader.stats) - pruned.blob_bytes,
            table_bytes=sizes["table_bytes"],
            index_bytes=sizes["index_bytes"],
            seconds=self.seconds,
            top_t=top_t,
            suffix_choice=self.choice,
            spark=spark,
        )
