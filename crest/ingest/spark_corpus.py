"""Reading and tokenizing a corpus on Spark executors, in the order the in-process engine reads it.

Inputs resolve on the driver as `crest.ingest.corpus` resolves them (files, sorted recursive directory walks,
globs; the format given or detected per file), plus Parquet (a `.parquet` file or a directory of them, rows
in (file, row) order) and paths with a scheme (`hdfs://`, `s3a://`...), listed through Spark's Hadoop file
system and read whole on one executor each. Executors parse files with the in-process readers, so documents,
empty and dropped records are the same; the documents are numbered in input order (`zipWithIndex`), spread
over the token partitions by number and tokenized there, the tokenizer loaded once per worker process. Each
token partition holds whole documents: (partition index, tokens [N] int32, document offsets [D + 1] int64).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from crest.decoding.tokenizer import Tokenizer, load_tokenizer
from crest.errors import CorpusError
from crest.ingest._files import FORMATS, CorpusReport, Sizes, detect, expand
from crest.ingest._records import turn_texts
from crest.ingest.corpus import file_documents

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import SparkSession

SPARK_FORMATS = (*FORMATS, "parquet")
SIZES = Sizes()  # iter_documents' defaults
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_TOKENIZERS: dict[str, Tokenizer] = {}  # per Python worker: loaded once, reused by its tasks

Part = tuple[int, np.ndarray, np.ndarray]  # (partition index, tokens [N] int32, document offsets [D + 1] int64)


@dataclass(frozen=True)
class Source:
    """One resolved input: a local file with its format, a remote file, or a Parquet dataset."""

    path: str
    kind: str  # sharegpt | jsonl | files | auto (a remote file, detected once read) | parquet
    remote: bool = False


def resolve_sources(spark: SparkSession, inputs: list[str], fmt: str) -> list[Source]:
    """Resolve every input before any work; a missing file or an unknown format fails here."""
    if fmt not in SPARK_FORMATS:
        raise CorpusError(f"unknown format {fmt!r}: use one of {', '.join(SPARK_FORMATS)}")
    if not inputs:
        raise CorpusError("no input given")
    out: list[Source] = []
    for spec in inputs:
        remote = bool(_SCHEME.match(spec)) and not spec.startswith("file://")
        local = spec.removeprefix("file://")
        if fmt == "parquet" or (fmt == "auto" and _is_parquet(spark, spec if remote else local, remote)):
            out.append(Source(spec if remote else str(Path(local).expanduser().resolve()), "parquet", remote))
        elif remote:
            files = _list_remote(spark, spec)
            kind = fmt if fmt != "auto" else ("auto" if files == [spec] else "files")
            out.extend(Source(f, kind, True) for f in files)
        else:
            out.extend(Source(str(path), kind) for path, kind in expand(local, fmt))
    return out


def _is_parquet(spark: SparkSession, spec: str, remote: bool) -> bool:
    """Tell whether an input is a .parquet file or a directory holding only .parquet data files."""
    if spec.rstrip("/").lower().endswith(".parquet"):
        return True
    if remote:
        names = [f.rsplit("/", 1)[-1] for f in _list_remote(spark, spec)]
    else:
        path = Path(spec).expanduser()
        names = [p.name for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    data = [n for n in names if not n.startswith((".", "_"))]
    return bool(data) and all(n.lower().endswith(".parquet") for n in data)


def _list_remote(spark: SparkSession, spec: str) -> list[str]:
    """Return the data files of a remote path (a file, a directory walked recursively, or a glob), sorted."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    path = jvm.org.apache.hadoop.fs.Path(spec)
    fs = path.getFileSystem(conf)
    statuses = fs.globStatus(path)
    if not statuses:
        raise CorpusError(f"input {spec!r} does not exist")
    found: list[str] = []
    for status in statuses:
        if status.isFile():
            found.append(status.getPath().toString())
            continue
        it = fs.listFiles(status.getPath(), True)
        while it.hasNext():
            item = it.next().getPath()
            rel = item.toString()[len(status.getPath().toString()) :]
            if not any(part.startswith((".", "_")) for part in rel.split("/") if part):
                found.append(item.toString())
    if not found:
        raise CorpusError(f"input {spec!r} holds no file")
    return sorted(found)


def read_documents(spark: SparkSession, sources: list[Source], *, slices: int) -> RDD[Any]:
    """Return an RDD of ('d', document) and ('r', report) items, documents in input order across partitions."""
    sc = spark.sparkContext
    rdds: list[RDD[Any]] = []
    local: list[Source] = []

    def flush() -> None:
        if local:
            rdd = sc.parallelize(list(local), max(1, min(len(local), slices)))
            rdds.append(rdd.mapPartitions(_read_local))
            local.clear()

    for source in sources:
        if source.kind == "parquet":
            flush()
            rdds.append(_parquet_documents(spark, source.path))
        elif source.remote:
            flush()
            rdds.append(sc.binaryFiles(source.path, 1).mapPartitions(partial(_read_remote, source=source)))
        else:
            local.append(source)
    flush()
    return rdds[0] if len(rdds) == 1 else sc.union(rdds)


def _read_local(sources: Iterable[Source]) -> Iterator[tuple[str, Any]]:
    rep = CorpusReport()
    for source in sources:
        rep.files += 1
        yield from _documents(Path(source.path), source.kind, rep)
    yield "r", rep


def _read_remote(items: Iterable[tuple[str, bytes]], source: Source) -> Iterator[tuple[str, Any]]:
    """Read a remote file from a local copy with the in-process readers."""
    rep = CorpusReport()
    for _, data in items:
        rep.files += 1
        suffix = Path(source.path).suffix
        with tempfile.TemporaryDirectory(prefix="crest-spark-") as tmp:
            path = Path(tmp, f"input{suffix}")
            path.write_bytes(data)
            kind = detect(path) if source.kind == "auto" else source.kind
            yield from _documents(path, kind, rep)
    yield "r", rep


def _documents(path: Path, kind: str, rep: CorpusReport) -> Iterator[tuple[str, Any]]:
    """Yield ('d', text or list of pieces) for the non-empty documents of one file, counting the empty ones."""
    for doc in file_documents(path, kind, rep, SIZES):
        if isinstance(doc, str) and not doc.strip():
            rep.empty_documents += 1
            continue
        rep.documents += 1
        yield "d", doc if isinstance(doc, str) else list(doc)


def _parquet_documents(spark: SparkSession, path: str) -> RDD[Any]:
    """Return the documents of a Parquet dataset: each row's `text`, or its turns, in (file, row) order."""
    frame = spark.read.parquet(path).select("*", "_metadata.file_path", "_metadata.row_index")
    ordered = frame.orderBy("file_path", "row_index")
    name = Path(path).name

    def rows(items: Iterable[Any]) -> Iterator[tuple[str, Any]]:
        rep = CorpusReport(files=0)
        for row in items:
            record = row.asDict(recursive=True)
            where = f"row {record.pop('row_index')}"
            record.pop("file_path")
            for text in turn_texts(record, Path(name), where, rep):
                rep.bytes_read += len(text)
                if text.strip():
                    rep.documents += 1
                    yield "d", text
                else:
                    rep.empty_documents += 1
        yield "r", rep

    return ordered.rdd.mapPartitions(rows)


def corpus_report(items: RDD[Any]) -> CorpusReport:
    """Return the sum of the reading tasks' reports."""
    report = CorpusReport()
    for part in items.filter(lambda item: item[0] == "r").map(lambda item: item[1]).collect():
        for key in ("files", "documents", "empty_documents", "dropped_records", "skipped_files", "bytes_read"):
            setattr(report, key, getattr(report, key) + getattr(part, key))
        report.drop_reasons.extend(part.drop_reasons[: max(0, 100 - len(report.drop_reasons))])
        report.notes.extend(part.notes)
    return report


def number_documents(items: RDD[Any], partitions: int, total: int) -> RDD[Any]:
    """Return the `total` documents numbered in input order, spread over `partitions` by number (sorted within)."""
    docs = items.filter(lambda item: item[0] == "d").map(lambda item: item[1]).zipWithIndex()
    spread = docs.map(lambda pair: (pair[1], pair[0])).repartitionAndSortWithinPartitions(
        partitions, partitionFunc=lambda i: i * partitions // max(1, total)
    )
    return spread


def tokenize_partition(index: int, docs: Iterable[tuple[int, Any]], spec: str) -> Iterator[Part]:
    """Tokenize one partition's documents as `tokenize_corpus` does (texts in batches, pieces one by one)."""
    tok = _TOKENIZERS.get(spec)
    if tok is None:
        tok = _TOKENIZERS[spec] = load_tokenizer(spec)
    lengths: list[int] = []
    parts: list[np.ndarray] = []
    texts: list[str] = []
    owners: list[int] = []
    chars = 0

    def flush() -> None:
        nonlocal chars
        for owner, ids in zip(owners, tok.encode_batch(texts), strict=True):
            lengths[owner] += len(ids)
            parts.append(np.asarray(ids, dtype=np.int32))
        texts.clear()
        owners.clear()
        chars = 0

    for _, doc in docs:
        lengths.append(0)
        for piece in (doc,) if isinstance(doc, str) else doc:
            if piece:
                texts.append(piece)
                owners.append(len(lengths) - 1)
                chars += len(piece)
            if len(texts) >= 2048 or chars >= 2_000_000:
                flush()
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    offsets = np.r_[0, np.cumsum(np.asarray(lengths, dtype=np.int64))].astype(np.int64)
    yield index, tokens, offsets
