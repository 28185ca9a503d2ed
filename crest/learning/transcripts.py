"""Transcripts of served requests read from files (`crest learn`): JSONL records or plain text files.

A `.jsonl` / `.ndjson` file holds one record a line: `{"tokens": [ids]}` (optionally `"prompt_tokens": k`),
`{"text": "..."}`, or `{"prompt": "...", "completion": "..."}` (or `"response"`), whose prompt is kept as
context (`prompt_tokens`). A record's context is kept as a server keeps a request's
(`crest.learning.requests.served_tokens`: its last `PROMPT_TAIL` tokens), so a transcript and the same request
served teach the same row. Any other file is one plain-text transcript. Text is tokenized with the store's own
tokenizer (the one its static version was built with). Every file is read and checked before anything is
appended, so a bad line leaves the log unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crest import db
from crest.decoding.tokenizer import Tokenizer, load_tokenizer
from crest.errors import CorpusError, StoreNotFound, TokenizerError
from crest.learning.journal import append_learned
from crest.learning.live import published_version
from crest.learning.requests import served_tokens

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class Transcripts:
    """Token lists read from files, with how many leading ids of each are prompt context."""

    token_lists: list[list[int]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    files: int = 0

    @property
    def tokens(self) -> int:
        """Return the number of tokens read."""
        return sum(len(t) for t in self.token_lists)

    def add(self, ids: list[int], prompt: int = 0) -> None:
        """Keep a non-empty token list."""
        if ids:
            self.token_lists.append(ids)
            self.prompt_tokens.append(prompt)


def store_tokenizer(dsn: str, store: str) -> Tokenizer:
    """Load the tokenizer the store's static version was built with (its fingerprint checked)."""
    with db.session(dsn) as conn:
        static = published_version(conn, store, "static")
    if static is None:
        raise StoreNotFound(f"no published store named {store!r}")
    tok = load_tokenizer(str(static["tokenizer"]))
    if tok.fingerprint != static["tokenizer_fingerprint"]:
        raise TokenizerError(f"tokenizer {static['tokenizer']!r} has changed since store {store!r} was built")
    return tok


def read_transcripts(paths: Sequence[str | Path], tok: Tokenizer) -> Transcripts:
    """Read and tokenize every file; raise CorpusError naming the file (and line) of the first bad input."""
    out = Transcripts()
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise CorpusError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CorpusError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        if path.suffix.lower() in JSONL_SUFFIXES:
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    ids, prompt = _record(line, tok, where=f"{path}:{number}")
                    out.add(ids, prompt)
        else:
            out.add(tok.encode(text))
        out.files += 1
    return out


def _record(line: str, tok: Tokenizer, *, where: str) -> tuple[list[int], int]:
    """Return (token ids, prompt tokens) of one JSONL record."""
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected an object, got {type(record).__name__}")
    if "tokens" in record:
        ids = record["tokens"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CorpusError(f'{where}: "tokens" must be a list of integer token ids')
        bad = [i for i in ids if not 0 <= i < tok.vocab_size]
        if bad:
            raise CorpusError(f"{where}: token id {bad[0]} is outside the store's vocabulary (0..{tok.vocab_size - 1})")
        prompt = record.get("prompt_tokens", 0)
        if not isinstance(prompt, int) or isinstance(prompt, bool) or not 0 <= prompt <= len(ids):
            raise CorpusError(f'{where}: "prompt_tokens" must be an integer between 0 and {len(ids)}')
        return served_tokens(ids[:prompt], ids[prompt:])
    if isinstance(record.get("text"), str):
        return tok.encode(record["text"]), 0
    answer = record.get("completion", record.get("response"))
    if isinstance(record.get("prompt"), str) and isinstance(answer, str):
        return served_tokens(tok.encode(record["prompt"]), tok.encode(answer))
    raise CorpusError(f'{where}: expected "tokens", "text", or "prompt" with "completion" or "response"')


def learn_files(dsn: str, store: str, paths: Sequence[str | Path], *, source: str = "file") -> Transcripts:
    """Read transcripts from files with the store's tokenizer and append them to its learned log, all or none."""
    tok = store_tokenizer(dsn, store)
    found = read_transcripts(paths, tok)
    if found.tokens == 0:  # as an ingest of an empty corpus: nothing written, and said
        raise CorpusError(f"nothing to learn: no token in {', '.join(map(str, paths))}")
    append_learned(dsn, store, found.token_lists, prompt_tokens=found.prompt_tokens, source=source)
    return found
