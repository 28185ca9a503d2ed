"""Tokenizers and corpus tokenization into a flat, memory-mapped token array with document offsets.

`load_tokenizer` accepts a Hugging Face tokenizer directory or name (local files only: nothing is
downloaded) or a `.gguf` file; a GGUF tokenizer is converted once and cached under `$CREST_HOME/tokenizers`.
The fingerprint is a hash of the full token -> id vocabulary, so stores and clients can check they agree.
`tokenize_corpus` encodes documents in batches with the fast tokenizer (exactly
`encode(text, add_special_tokens=False)` per document) and appends the ids to a file, so memory stays
bounded whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crest.errors import TokenizerError

Advance = Callable[[int], None]


class Tokenizer:
    """A loaded tokenizer with the figures crest needs."""

    def __init__(self, hf: Any, spec: str) -> None:
        self.hf = hf
        self.spec = spec
        vocab: dict[str, int] = hf.get_vocab()
        if not vocab:
            raise TokenizerError(f"tokenizer {spec!r} has an empty vocabulary")
        pairs = sorted(((int(i), t) for t, i in vocab.items()))
        self.vocab_size = pairs[-1][0] + 1
        self.fingerprint = hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()
        eos = getattr(hf, "eos_token_id", None)
        self.eos_token_ids = [int(eos)] if eos is not None else []

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text` without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Return the token ids of each text without special tokens."""
        return list(self.hf(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])

    def pieces(self) -> list[tuple[int, str]]:
        """Return (id, text) for every id of the vocabulary, for rendering n-grams in SQL."""
        ids = list(range(self.vocab_size))
        texts = self.hf.batch_decode([[i] for i in ids], skip_special_tokens=False)
        return [(i, t.replace("\x00", "")) for i, t in zip(ids, texts, strict=True)]


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from a directory, a local Hugging Face name or a .gguf file."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer

        path = Path(spec).expanduser()
        try:
            if path.suffix == ".gguf":
                if not path.is_file():
                    raise TokenizerError(f"tokenizer file {spec!r} does not exist")
                hf = _load_gguf(path)
            elif path.exists():
                hf = AutoTokenizer.from_pretrained(str(path))
            else:
                hf = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except TokenizerError:
            raise
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer {spec!r}: {str(exc).splitlines()[0][:300]}") from None
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {spec!r} is not a fast (Rust) tokenizer")
    return Tokenizer(hf, spec)


def _load_gguf(path: Path) -> Any:
    """Load a GGUF tokenizer, converting it once into a cached tokenizer directory."""
    from crest_client.embedded import crest_home
    from transformers import AutoTokenizer

    stat = path.stat()
    tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = crest_home() / "tokenizers" / tag
    if (cache / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:
            pass  # a damaged cache is rebuilt below
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = cache.with_name(f"{tag}.tmp{os.getpid()}")
    try:
        hf.save_pretrained(str(tmp))
        tmp.rename(cache)  # atomic: readers see no half-written cache
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or the disk is read-only
    return hf


@dataclass
class TokenizedCorpus:
    """A corpus as one token array; document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]."""

    tokens: np.ndarray  # [N] int32, memory-mapped
    doc_offsets: np.ndarray  # [D + 1] int64
    documents: int
    tokens_total: int
    seconds: float


def tokenize_corpus(
    documents: Iterable[Iterable[str]],
    tokenizer: Tokenizer,
    *,
    workdir: Path,
    batch_chars: int = 4_000_000,
    progress: Advance | None = None,
) -> TokenizedCorpus:
    """Tokenize documents (each a sequence of text pieces) into `workdir/tokens.i32`."""
    start = time.perf_counter()
    path = Path(workdir) / "tokens.i32"
    offsets: list[int] = [0]
    total = 0
    batch: list[str] = []
    owners: list[int] = []  # document number of each text in the batch
    lengths: list[int] = []  # tokens per document so far
    chars = 0

    with open(path, "wb") as sink:

        def flush() -> None:
            nonlocal total, chars
            if not batch:
                return
            for owner, ids in zip(owners, tokenizer.encode_batch(batch), strict=True):
                arr = np.asarray(ids, dtype=np.int32)
                sink.write(arr.tobytes())
                lengths[owner] += len(arr)
                total += len(arr)
                if progress is not None:
                    progress(len(arr))
            batch.clear()
            owners.clear()
            chars = 0

        for doc in documents:
            lengths.append(0)
            for piece in doc:
                batch.append(piece)
                owners.append(len(lengths) - 1)
                chars += len(piece)
                if chars >= batch_chars:
                    flush()
            if len(lengths) > 4096 and not batch:
                _fold(offsets, lengths)
        flush()
    _fold(offsets, lengths)
    doc_offsets = np.asarray(offsets, dtype=np.int64)
    tokens = np.memmap(path, dtype=np.int32, mode="r", shape=(total,)) if total else np.zeros(0, dtype=np.int32)
    return TokenizedCorpus(tokens, doc_offsets, len(offsets) - 1, total, time.perf_counter() - start)


def _fold(offsets: list[int], lengths: list[int]) -> None:
    """Move finished documents' lengths into cumulative offsets (keeps `lengths` short)."""
    for length in lengths:
        offsets.append(offsets[-1] + length)
    lengths.clear()
