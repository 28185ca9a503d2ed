"""Tree blob codec: round trips for any well-ordered tree, and clear errors for anything malformed."""

from __future__ import annotations

import numpy as np
import pytest
from crest_client.codec import decode_tree, encode_tree, token_width
from crest_client.errors import CodecError
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def trees(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    vocab = draw(st.sampled_from([2, 255, 256, 257, 49152, 65536, 65537, 151936, 2**31]))
    size = draw(st.integers(0, 300))
    tokens = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size)), dtype=np.int64)
    parents = np.array([draw(st.integers(-1, i - 1)) for i in range(size)], dtype=np.int32)
    top = draw(st.sampled_from([1, 200, 255, 256, 70000, 2**40]))
    weights = np.sort(np.array(draw(st.lists(st.integers(1, top), min_size=size, max_size=size)), dtype=np.int64))[
        ::-1
    ].copy()
    return tokens, parents, weights, vocab


@settings(max_examples=300, deadline=None)
@given(trees(), st.booleans())
def test_round_trip(tree: tuple[np.ndarray, np.ndarray, np.ndarray, int], compress: bool) -> None:
    tokens, parents, weights, vocab = tree
    blob = encode_tree(tokens, parents, weights, vocab_size=vocab, compress=compress)
    draft = decode_tree(blob, n=3)
    assert draft.tokens.tolist() == tokens.tolist()
    assert draft.parents.tolist() == parents.tolist()
    assert draft.weights.tolist() == weights.tolist()
    assert draft.n == 3


@pytest.mark.parametrize(
    ("vocab", "width"), [(256, 1), (257, 2), (49152, 2), (65536, 2), (65537, 4), (151936, 4)], ids=str
)
def test_token_width_is_narrowest(vocab: int, width: int) -> None:
    assert token_width(vocab) == width
    tokens = np.full(10, vocab - 1, dtype=np.int64)
    blob = encode_tree(
        tokens, np.arange(-1, 9, dtype=np.int32), np.ones(10, np.int64), vocab_size=vocab, compress=False
    )
    assert len(blob) == 3 + 10 * width + 10 + 10  # header: version, flags, u8 count


def test_lz4_used_for_repetitive_payloads() -> None:
    repetitive = encode_tree(np.zeros(64, np.int64), np.arange(-1, 63), np.ones(64, np.int64), vocab_size=49152)
    assert repetitive[1] & 1 == 1
    assert len(repetitive) < 4 + 64 * 4


@settings(max_examples=200, deadline=None)
@given(trees())
def test_compression_never_makes_a_blob_larger(tree: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    tokens, parents, weights, vocab = tree
    packed = encode_tree(tokens, parents, weights, vocab_size=vocab)
    plain = encode_tree(tokens, parents, weights, vocab_size=vocab, compress=False)
    assert len(packed) <= len(plain)
    assert (packed[1] & 1 == 1) == (len(packed) < len(plain))


def _valid_blob() -> bytes:
    return encode_tree(np.arange(5), np.array([-1, 0, 0, 1, 3]), np.array([9, 5, 4, 4, 1]), vocab_size=100)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "shorter than its header"),
        (b"\x01", "shorter than its header"),
        (bytes([1, 0x80, 5]), "shorter than its header"),
        (bytes([9, 0, 0]), "unknown format version 9"),
        (bytes([1, 0, 5, 0, 0, 0]), "expected 15"),
        (bytes([1, 1, 5, 0xFF, 0xFF, 0xFF]), "lz4"),
        (bytes([1, 0, 2, 1, 2, 2, 0, 5, 4]), "before its parent"),
        (bytes([1, 0, 2, 1, 2, 0, 1, 4, 5]), "weights increase"),
        (bytes([1, 1 << 5, 2, 1, 2, 0, 1, 3]), "more wide weights"),
        (bytes([1, 1 << 5, 2, 1, 2, 0, 1]), "too short"),
    ],
    ids=[
        "empty",
        "short",
        "short-long-count",
        "version",
        "truncated",
        "bad-lz4",
        "parent-order",
        "weights-order",
        "wide-run",
        "no-wide-run",
    ],
)
def test_malformed_blobs_raise_codec_error(blob: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_tree(blob)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_decoder_raises_only_codec_error(blob: bytes) -> None:
    try:
        draft = decode_tree(blob)
    except CodecError:
        return
    draft.validate()


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255))
def test_fuzz_single_byte_corruption(position: int, value: int) -> None:
    blob = bytearray(_valid_blob())
    blob[position % len(blob)] = value
    try:
        draft = decode_tree(bytes(blob))
    except CodecError:
        return
    draft.validate()
