"""The target model's tokenizer: loaded from a Hugging Face directory or name, a tokenizer.json or a GGUF file.

`load_tokenizer` accepts a Hugging Face tokenizer directory, a `tokenizer.json` file, a name already in the
local Hugging Face cache (nothing is downloaded) or a `.gguf` file; a GGUF tokenizer is converted once and
cached under `$CREST_HOME/tokenizers`. The fingerprint hashes the full token -> id vocabulary, added tokens
included, so stores and clients can check that they agree. The model, the store builders (`crest.ingest`), the
drafters and the servers all take their tokenizer from here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from crest.config import resolve_model_spec
from crest.errors import TokenizerError


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
            elif path.is_dir() and not any(path.glob("tokenizer*")) and not (path / "config.json").is_file():
                raise TokenizerError(f"cannot load tokenizer {spec!r}: the directory holds no tokenizer files")
            elif path.exists():
                hf = AutoTokenizer.from_pretrained(str(path))
            elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
                raise TokenizerError(f"cannot load tokenizer {spec!r}: no such file or directory")
            else:
                hf = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except TokenizerError:
            raise
        except Exception as exc:
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__  # the whole reason, on one line
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
