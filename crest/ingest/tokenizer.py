"""Tokenizers and corpus tokenization into a flat, memory-mapped token array with document offsets.

`load_tokenizer` accepts a Hugging Face tokenizer directory, a `tokenizer.json` file, a name already in the
local Hugging Face cache (nothing is downloaded) or a `.gguf` file; a GGUF tokenizer is converted once and
cached under `$CREST_HOME/tokenizers`. The fingerprint hashes the full token -> id vocabulary, added tokens
included, so stores and clients can check that they agree. `tokenize_corpus` encodes documents in batches
with the fast tokenizer (each text exactly as `encode(text, add_special_tokens=False)`) and appends the ids
to a file, so memory stays bounded whatever the corpus size; a streamed document (see `crest.corpus`) is
encoded piece by piece, so its tokenization is split where its pieces were cut, at line ends.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import warnings
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crest.config import resolve_model_spec
from crest.errors import ConfigError, TokenizerError

Advance = Callable[[int], None]


class Tokenizer:
    """A loaded fast tokenizer with the figures crest needs."""

    def __init__(self, hf: Any, spec: str) -> None:
        self.hf = hf
        self.spec = spec
        vocab: dict[str, int] = hf.get_vocab()
        if not vocab:
            raise TokenizerError(f"tokenizer {spec!r} has an empty vocabulary")
        pairs = sorted((int(i), t) for t, i in vocab.items())
        self.vocab_size = pairs[-1][0] + 1
        canonical = json.dumps(pairs, ensure_ascii=False, separators=(",", ":"))
        self.fingerprint = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
        self.eos_token_ids = _eos_ids(hf)

    def __repr__(self) -> str:
        return f"Tokenizer({self.spec!r}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text` without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False, verbose=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Return the token ids of each text without special tokens (same ids as `encode`)."""
        if not texts:
            return []
        backend: Any = getattr(self.hf, "backend_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None)
        if fast is None:
            out = self.hf(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
            return list(out["input_ids"])
        # the settings `hf(...)` would apply; skipping offsets halves time and memory on long texts
        backend.encode_special_tokens = bool(getattr(self.hf, "split_special_tokens", False))
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def pieces(self) -> list[tuple[int, str]]:
        """Return (id, text) for every id below `vocab_size`, NUL characters removed, for SQL rendering."""
        ids = list(range(self.vocab_size))
        texts = self.hf.batch_decode([[i] for i in ids], skip_special_tokens=False)
        return [(i, t.replace("\x00", "")) for i, t in zip(ids, texts, strict=True)]


def _eos_ids(hf: Any) -> list[int]:
    """Return the end-of-sequence ids the tokenizer declares, sorted."""
    ids: list[int] = []
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, list):
        ids.extend(int(i) for i in eos)
    return sorted(set(ids))


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer from a directory, a tokenizer.json, a cached Hugging Face name, a .gguf file or `smollm2`."""
    spec = os.fspath(spec)
    if not spec:
        raise TokenizerError("no tokenizer given")
    spec = resolve_model_spec(spec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    path = Path(spec).expanduser()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            if path.suffix.lower() == ".gguf":
                if not path.is_file():
                    raise TokenizerError(f"cannot load tokenizer {spec!r}: no such file")
                hf = _load_gguf(path)
            elif path.is_file() and path.suffix.lower() == ".json":
                hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
            elif path.is_file():
                raise TokenizerError(f"cannot load tokenizer {spec!r}: a file, but neither .gguf nor tokenizer .json")
            elif path.exists():
                hf = AutoTokenizer.from_pretrained(str(path))
            elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
                raise TokenizerError(f"cannot load tokenizer {spec!r}: no such file or directory")
            else:
                hf = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except TokenizerError:
            raise
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TokenizerError(f"cannot load tokenizer {spec!r}: {reason}") from None
    if hf is None or not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {spec!r} is not a fast (Rust) tokenizer")
    return Tokenizer(hf, spec)


def _load_gguf(path: Path) -> Any:
    """Load a GGUF tokenizer, converting it once into a cached tokenizer directory."""
    import transformers
    from crest_client.embedded import crest_home
    from transformers import AutoTokenizer

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = crest_home() / "tokenizers" / tag
    if (cache / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:
            shutil.rmtree(cache, ignore_errors=True)  # damaged: rebuilt below
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = cache.with_name(f"{tag}.tmp{os.getpid()}")
    try:
        hf.save_pretrained(str(tmp))
        tmp.rename(cache)  # atomic: readers never see a half-written cache
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or the disk is read-only
    return hf


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
