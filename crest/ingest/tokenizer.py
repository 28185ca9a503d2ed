"""Corpus tokenization into a flat, memory-mapped token array with document offsets.

`tokenize_corpus` encodes documents in batches with the fast tokenizer of the model
(`crest.decoding.tokenizer`; each text exactly as `encode(text, add_special_tokens=False)`) and appends the ids
to a file, so memory stays bounded whatever the corpus size; a streamed document (see `crest.corpus`) is
encoded piece by piece, so its tokenization is split where its pieces were cut, at line ends.
"""

from __future__ import annotations

import itertools
import os
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crest.decoding.tokenizer import Tokenizer
from crest.errors import ConfigError, TokenizerError

Advance = Callable[[int], None]


@dataclass
class TokenizedCorpus:
    """A corpus as one token array; document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]."""

    tokens: np.ndarray  # [N] int32, memory-mapped from `path`
    doc_offsets: np.ndarray  # [D + 1] int64
    documents: int
    tokens_total: int
    seconds: float
    path: Path | None = None

    @property
    def tokens_per_second(self) -> float:
        """Return the tokenization throughput."""
        return self.tokens_total / self.seconds if self.seconds > 0 else 0.0

    def document(self, index: int) -> np.ndarray:
        """Return the token ids of document `index`."""
        return np.asarray(self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]])


def tokenize_corpus(
    documents: Iterable[str | Iterable[str]],
    tokenizer: Tokenizer,
    *,
    workdir: str | os.PathLike[str],
    batch_size: int = 2048,
    batch_chars: int = 2_000_000,
    progress: Advance | None = None,
) -> TokenizedCorpus:
    """Tokenize documents (each a string or an iterable of text pieces) into `workdir/tokens.i32`."""
    if batch_size < 1 or batch_chars < 1:
        raise ConfigError(f"batch_size and batch_chars must be positive, not {batch_size} and {batch_chars}")
    start = time.perf_counter()
    path = Path(workdir) / "tokens.i32"
    batch = _Batch(tokenizer, progress)
    try:
        with open(path, "wb") as sink:
            for doc in documents:
                batch.open_document()
                for piece in (doc,) if isinstance(doc, str) else doc:
                    batch.add(piece)
                    if len(batch.texts) >= batch_size or batch.chars >= batch_chars:
                        batch.flush(sink)
            batch.flush(sink)
    except OSError as exc:
        raise TokenizerError(f"cannot write tokens to {str(path)!r}: {exc.strerror or exc}") from None
    offsets = np.zeros(len(batch.lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(batch.lengths, dtype=np.int64), out=offsets[1:])
    total = int(offsets[-1])
    tokens = np.memmap(path, dtype=np.int32, mode="r", shape=(total,)) if total else np.zeros(0, dtype=np.int32)
    return TokenizedCorpus(tokens, offsets, len(offsets) - 1, total, time.perf_counter() - start, path)


class _Batch:
    """Texts waiting to be encoded together, and the token count of every document so far."""

    def __init__(self, tokenizer: Tokenizer, progress: Advance | None) -> None:
        self.tokenizer, self.progress = tokenizer, progress
        self.texts: list[str] = []
        self.owners: list[int] = []  # document index of each text
        self.lengths = array("q")  # [D] tokens per document
        self.chars = 0

    def open_document(self) -> None:
        self.lengths.append(0)

    def add(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a document piece must be str, not {type(text).__name__}")
        if text:
            self.texts.append(text)
            self.owners.append(len(self.lengths) - 1)
            self.chars += len(text)

    def flush(self, sink: Any) -> None:
        """Encode the waiting texts and append their ids to `sink`."""
        if not self.texts:
            return
        encoded = self.tokenizer.encode_batch(self.texts)
        count = 0
        for owner, ids in zip(self.owners, encoded, strict=True):
            self.lengths[owner] += len(ids)
            count += len(ids)
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=count)
        sink.write(flat.tobytes())
        self.texts.clear()
        self.owners.clear()
        self.chars = 0
        if self.progress is not None:
            self.progress(count)
