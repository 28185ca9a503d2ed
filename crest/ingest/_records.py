"""Records of JSON corpora and the texts they hold: ShareGPT arrays, JSONL lines, one record's turns.

Shared by the in-process reader (`crest.ingest.corpus`) and the Spark one (`crest.ingest.spark_corpus`).
`turn_texts` takes a record's texts (itself if a string, its `text`, or each turn of `conversations[].value`
or `messages[].content`), counting what it cannot use as dropped. `array_texts` streams a top-level JSON array
(`crest.ingest._json_array`), `jsonl_texts` a JSONL file; a record cut off by the end of the file is dropped and
reported, any other malformed record is a `CorpusError` naming the file and the place.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crest.errors import CorpusError
from crest.ingest._files import CorpusReport, Sizes, raw_chunks
from crest.ingest._json_array import array_records, cut_short

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean(text: str) -> str:
    """Replace lone surrogates (from JSON escapes such as \\ud83d) that no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def turn_texts(record: Any, path: Path, where: str, rep: CorpusReport) -> Iterator[str]:
    """Yield the texts of one record: itself if a string, its `text`, or each turn's text.

    Turns are `conversations[].value` (ShareGPT) or `messages[].content` (chat format).
    """
    if isinstance(record, str):
        yield clean(record)
        return
    if not isinstance(record, dict):
        rep.drop(f"{path.name} {where}: neither a JSON object nor a string")
        return
    text = record.get("text")
    if isinstance(text, str):
        yield clean(text)
        return
    for list_key, text_key in (("conversations", "value"), ("messages", "content")):
        turns = record.get(list_key)
        if not isinstance(turns, list):
            continue
        for number, turn in enumerate(turns, 1):
            value = turn.get(text_key) if isinstance(turn, dict) else None
            if isinstance(value, str):
                yield clean(value)
            else:
                rep.drop(f"{path.name} {where} turn {number}: no string {text_key!r}")
        return
    if "text" in record:
        rep.drop(f"{path.name} {where}: 'text' is not a string (a {type(text).__name__})")
    else:
        rep.drop(f"{path.name} {where}: no 'text', 'conversations' or 'messages'")


def array_texts(path: Path, rep: CorpusReport, sizes: Sizes) -> Iterator[str]:
    """Stream the texts of a top-level JSON array's records; a truncated last record is dropped and reported."""
    for number, record in enumerate(array_records(path, rep, sizes), 1):
        yield from turn_texts(record, path, f"record {number}", rep)


def jsonl_texts(path: Path, rep: CorpusReport, sizes: Sizes) -> Iterator[str]:
    """Stream a JSONL file; a malformed line is an error, except a cut-off last line, which is reported."""
    number, offset, pending = 0, 0, b""
    max_record = sizes.record
    for raw in raw_chunks(path, rep, sizes.read):
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
        if last and cut_short(text, exc):
            rep.drop(f"{path.name}: line {number} truncated at byte {offset} (file ends mid-record)")
            return
        raise CorpusError(f"{str(path)!r} line {number} is not valid JSON: {exc.msg} (column {exc.colno})") from None
    yield from turn_texts(record, path, f"line {number}", rep)
