"""Corpus files: resolving inputs to files, detecting their format, reading their bytes and text in bounded chunks.

Shared by the in-process reader (`crest.ingest.corpus`) and the Spark one (`crest.ingest.spark_corpus`).
`expand` resolves one input (a file, a directory walked recursively and sorted, hidden entries skipped, or a glob)
to (file, format) pairs and fails, before any work, on a missing, empty or unreadable input. `raw_chunks` and
`text_chunks` read a file in `size`-byte chunks, counting the bytes read in the `CorpusReport`. Anything missing or
unreadable raises `CorpusError` naming the file.
"""

from __future__ import annotations

import codecs
import glob
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from crest.errors import CorpusError

FORMATS = ("auto", "sharegpt", "jsonl", "files")
GLOB_CHARS = frozenset("*?[")
_MAX_REASONS = 100


@dataclass
class CorpusReport:
    """Counters of what reading the corpus found."""

    inputs: int = 0
    files: int = 0
    documents: int = 0
    empty_documents: int = 0
    dropped_records: int = 0
    drop_reasons: list[str] = field(default_factory=list)
    skipped_files: int = 0
    bytes_read: int = 0
    notes: list[str] = field(default_factory=list)

    def drop(self, reason: str, count: int = 1) -> None:
        """Count `count` dropped records with a reason (the first hundred reasons are kept)."""
        self.dropped_records += count
        if len(self.drop_reasons) < _MAX_REASONS:
            self.drop_reasons.append(reason)

    def summary(self) -> str:
        """Return a one-paragraph account of the counters and why records were dropped."""
        text = (
            f"{self.inputs} input(s), {self.files} file(s), {self.bytes_read:,} bytes read: "
            f"{self.documents:,} document(s), {self.empty_documents:,} empty document(s) skipped"
        )
        if self.dropped_records:
            noun = "record" if self.dropped_records == 1 else "records"
            text += f"; {self.dropped_records:,} {noun} dropped: " + "; ".join(self.drop_reasons[:5])
            if len(self.drop_reasons) > 5:
                text += "; ..."
        if self.notes:
            text += "; note: " + "; ".join(self.notes[:5])
        return text


@dataclass(frozen=True)
class Sizes:
    """Byte sizes bounding memory: streamed pieces, the largest JSON record, one read."""

    piece: int = 256 << 10
    record: int = 256 << 20
    read: int = 1 << 20


def expand(spec: str, fmt: str) -> Iterator[tuple[Path, str]]:
    """Resolve one input to (file, format) pairs: a file, a directory (recursive) or a glob."""
    if not spec:
        raise CorpusError("an input is an empty string")
    if GLOB_CHARS & set(spec) and not Path(spec).exists():
        hits = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
        files = [f for hit in hits for f in (_walk(Path(hit), spec) if Path(hit).is_dir() else [Path(hit)])]
        files = [f for f in files if _is_regular(f)]
        if not files:
            raise CorpusError(f"glob {spec!r} matches no file")
        for file in files:
            _check_readable(file)
            yield file, "files" if fmt == "auto" else fmt
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        files = _walk(path, spec)
        if not files:
            raise CorpusError(f"directory {spec!r} holds no file")
        for file in files:
            _check_readable(file)
            yield file, "files" if fmt == "auto" else fmt
        return
    if not path.exists():
        raise CorpusError(f"input {spec!r} does not exist")
    if not _is_regular(path):
        raise CorpusError(f"input {spec!r} is not a regular file")
    _check_readable(path)
    yield path, detect(path) if fmt == "auto" else fmt


def _walk(root: Path, spec: str) -> list[Path]:
    """Return the regular files under `root`, sorted, skipping hidden files and directories."""

    def fail(exc: OSError) -> None:
        raise CorpusError(f"cannot list directory {exc.filename!r} of input {spec!r}: {exc.strerror or exc}")

    found: list[Path] = []
    for here, dirs, names in os.walk(root, onerror=fail):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(here, n) for n in sorted(names) if not n.startswith(".") and _is_regular(Path(here, n)))
    return found


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _check_readable(path: Path) -> None:
    """Fail early, before any work, on a file this process may not read."""
    if not os.access(path, os.R_OK):
        raise CorpusError(f"cannot read {str(path)!r}: permission denied")


def detect(path: Path) -> str:
    """Pick a file's format: .jsonl -> jsonl; .json starting with '[' -> sharegpt; else files."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        with open_file(path) as handle:
            head = handle.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")
        if head.startswith(b"["):
            return "sharegpt"
    return "files"


def open_file(path: Path) -> IO[bytes]:
    """Open a file for reading bytes; an error is a CorpusError naming it."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def raw_chunks(path: Path, rep: CorpusReport | None, size: int) -> Iterator[bytes]:
    """Yield a file's bytes in chunks, counting them in `rep`."""
    with open_file(path) as handle:
        while True:
            try:
                raw = handle.read(size)
            except OSError as exc:
                raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
            if not raw:
                return
            if rep is not None:
                rep.bytes_read += len(raw)
            yield raw


def text_chunks(path: Path, rep: CorpusReport | None, size: int, *, cut_tail_ok: bool = False) -> Iterator[str]:
    """Yield the text of a UTF-8 file in chunks (BOM removed); invalid UTF-8 raises UnicodeDecodeError.

    With `cut_tail_ok`, a character cut off by the end of the file is dropped instead (a truncated file). Error
    positions count from the start of the file.
    """
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    offset = 0
    for raw in raw_chunks(path, rep, size):
        held = len(decoder.getstate()[0])  # bytes of a character the last chunk cut, decoded with this one
        try:
            text = decoder.decode(raw)
        except UnicodeDecodeError as exc:
            raise _shifted(exc, offset - held) from None
        offset += len(raw)
        if text:
            yield text
    held = len(decoder.getstate()[0])
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        if not (cut_tail_ok and exc.reason == "unexpected end of data"):
            raise _shifted(exc, offset - held) from None


def _shifted(exc: UnicodeDecodeError, offset: int) -> UnicodeDecodeError:
    """Return the error with its positions counted from the start of the file."""
    return UnicodeDecodeError(exc.encoding, exc.object, offset + exc.start, offset + exc.end, exc.reason)
