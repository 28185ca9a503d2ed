"""Tree blob codec: round trips for any well-ordered tree, and clear errors for anything malformed."""

from __future__ import annotations

import numpy as np
import pytest
from crest_client.codec import TokenTable, decode_tree, encode_tree, token_width, tree_nodes
from crest_client.errors import CodecError
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fix_drafts import trees


def _assert_same(draft: object, tokens: np.ndarray, parents: np.ndarray, weights: np.ndarray) -> None:
    assert draft.tokens.tolist() == tokens.tolist()  # type: ignore[attr-defined]
    assert draft.parents.tolist() == parents.tolist()  # type: ignore[attr-defined]
    assert draft.weights.tolist() == weights.tolist()  # type: ignore[attr-defined]


@settings(max_examples=100, deadline=None)
@given(trees(), st.booleans())
def test_round_trip_v1(tree: tuple[np.ndarray, np.ndarray, np.ndarray, int], compress: bool) -> None:
    tokens, parents, weights, vocab = tree
    blob = encode_tree(tokens, parents, weights, vocab_size=vocab, version=1, compress=compress)
    assert blob[0] == 1
    draft = decode_tree(blob, n=3)
    _assert_same(draft, tokens, parents, weights)
    assert draft.n == 3


@settings(max_examples=100, deadline=None)
@given(trees(), st.booleans(), st.randoms(use_true_random=False))
def test_round_trip_v2(tree: tuple[np.ndarray, np.ndarray, np.ndarray, int], ranked: bool, rnd: object) -> None:
    tokens, parents, weights, vocab = tree
    table = None
    if ranked:  # a table holding every tree token plus others, in a shuffled order
        ids = sorted(set(tokens.tolist()) | {int(t) for t in np.linspace(0, vocab - 1, 50, dtype=np.int64)})
        rnd.shuffle(ids)  # type: ignore[attr-defined]
        table = TokenTable(np.array(ids, dtype=np.int64))
    blob = encode_tree(tokens, parents, weights, vocab_size=vocab, table=table)
    assert blob[0] == 2
    draft = decode_tree(blob, n=2, table=table)
    _assert_same(draft, tokens, parents, weights)
    assert draft.n == 2


@pytest.mark.parametrize("ranked", [False, True], ids=["ids", "ranks"])
@pytest.mark.parametrize("size", range(1, 41), ids=lambda size: f"{size}-nodes")
def test_v2_unit_weight_steps_take_no_bits(size: int, ranked: bool) -> None:
    # every node drops the weight by exactly 1: steps are 0-bit fields, the last one at the stream's very end
    tokens = (np.arange(size) * 7919) % 49152
    parents = np.array([-1] + [(i * 5) // 7 - 1 for i in range(1, size)])
    weights = np.arange(size, 0, -1, dtype=np.int64) + 3
    table = TokenTable(np.unique(tokens)) if ranked else None
    blob = encode_tree(tokens, parents, weights, vocab_size=49152, table=table)
    assert (blob[1] >> 1) & 0x3F == 0  # step width
    _assert_same(decode_tree(blob, table=table), tokens, parents, weights)


def test_v2_chain_of_common_tokens_takes_under_9_bits_a_node() -> None:
    size = 64
    tokens = np.arange(size) % 16  # ranks 0-15: 2 class bits + 4 token bits
    blob = encode_tree(tokens, np.arange(-1, size - 1), np.ones(size, np.int64), vocab_size=49152)
    # header: version, flags, count, widest class, first weight; then 128 class + 63 chain + 256 token bits
    assert len(blob) == 5 + (128 + 63 + 256 + 7) // 8


def test_v2_is_smaller_than_v1_on_a_realistic_tree() -> None:
    rng = np.random.default_rng(0)
    size = 64
    parents = np.array([-1] + [i - 1 if rng.random() < 0.7 else int(rng.integers(-1, i)) for i in range(1, size)])
    weights = np.sort(rng.geometric(0.3, size))[::-1].copy()
    counts = np.bincount(rng.zipf(1.3, 20000) % 49152, minlength=49152)
    table = TokenTable.from_counts(counts)
    tokens = table.tokens[np.minimum(rng.zipf(1.5, size), len(table) - 1)]
    v1 = encode_tree(tokens, parents, weights, vocab_size=49152, version=1)
    v2 = encode_tree(tokens, parents, weights, vocab_size=49152, table=table)
    assert len(v2) < 0.7 * len(v1)
    _assert_same(decode_tree(v2, table=table), tokens, parents, weights)


def test_token_table_ranks_by_count_then_id() -> None:
    table = TokenTable.from_counts(np.array([0, 5, 7, 5, 0, 1]))
    assert table.tokens.tolist() == [2, 1, 3, 5]
    assert table.ranks_of(np.array([5, 2])).tolist() == [3, 0]
    assert TokenTable.from_bytes(table.to_bytes()).tokens.tolist() == [2, 1, 3, 5]
    with pytest.raises(CodecError, match="missing from the store's token table"):
        table.ranks_of(np.array([4]))
    with pytest.raises(CodecError, match="whole number"):
        TokenTable.from_bytes(b"\x01\x00\x00")
    with pytest.raises(CodecError, match="twice"):
        TokenTable(np.array([1, 1]))


def test_ranked_blob_needs_its_table() -> None:
    table = TokenTable(np.array([7, 3, 9]))
    blob = encode_tree(np.array([3, 9]), np.array([-1, 0]), np.array([2, 1]), vocab_size=10, table=table)
    with pytest.raises(CodecError, match="needs the store's token table"):
        decode_tree(blob)
    with pytest.raises(CodecError, match="beyond the store's token table"):
        decode_tree(blob, table=TokenTable(np.array([7, 3])))
    assert decode_tree(blob, table=table).tokens.tolist() == [3, 9]


@pytest.mark.parametrize(
    ("tokens", "parents", "weights", "message"),
    [
        ([1, 2], [-1, 1], [2, 1], "before its parent"),
        ([1, 2], [-1, 0], [1, 2], "weights increase"),
        ([1, 2], [-1, 0], [1, -1], "negative"),
        ([1, 2], [-1, 0], [1], "differ in length"),
    ],
    ids=["parent-order", "weights-order", "negative-weight", "lengths"],
)
def test_encoder_refuses_bad_trees(tokens: list[int], parents: list[int], weights: list[int], message: str) -> None:
    with pytest.raises(CodecError, match=message):
        encode_tree(np.array(tokens), np.array(parents), np.array(weights), vocab_size=10)


@pytest.mark.parametrize(
    ("vocab", "width"), [(256, 1), (257, 2), (49152, 2), (65536, 2), (65537, 4), (151936, 4)], ids=str
)
def test_token_width_is_narrowest(vocab: int, width: int) -> None:
    assert token_width(vocab) == width
    tokens = np.full(10, vocab - 1, dtype=np.int64)
    blob = encode_tree(
        tokens, np.arange(-1, 9, dtype=np.int32), np.ones(10, np.int64), vocab_size=vocab, version=1, compress=False
    )
    assert len(blob) == 3 + 10 * width + 10 + 10  # header: version, flags, u8 count


def test_lz4_used_for_repetitive_payloads() -> None:
    repetitive = encode_tree(
        np.zeros(64, np.int64), np.arange(-1, 63), np.ones(64, np.int64), vocab_size=49152, version=1
    )
    assert repetitive[1] & 1 == 1
    assert len(repetitive) < 4 + 64 * 4


@settings(max_examples=80, deadline=None)
@given(trees())
def test_compression_never_makes_a_blob_larger(tree: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    tokens, parents, weights, vocab = tree
    packed = encode_tree(tokens, parents, weights, vocab_size=vocab, version=1)
    plain = encode_tree(tokens, parents, weights, vocab_size=vocab, version=1, compress=False)
    assert len(packed) <= len(plain)
    assert (packed[1] & 1 == 1) == (len(packed) < len(plain))


def _v2_blob(count: int, bits: list[int], *, first: int = 1, step_bits: int = 0) -> bytes:
    """Return a hand-made unranked version-2 blob (widest class 0 bits), then `bits` packed LSB first."""
    head = bytes((2, step_bits << 1, count, 0, first))
    return head + np.packbits(np.array(bits, np.uint8), bitorder="little").tobytes()


def _valid_blob(version: int = 1) -> bytes:
    return encode_tree(
        np.arange(5), np.array([-1, 0, 0, 1, 3]), np.array([9, 5, 4, 4, 1]), vocab_size=100, version=version
    )


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "shorter than its header"),
        (b"\x01", "shorter than its header"),
        (bytes([1, 0x80, 5]), "shorter than its header"),
        (bytes([9, 0, 0]), "unknown format version 9"),
        (bytes([2, 0x80, 0]), "unknown flags"),
        (bytes([2, 0, 0, 0, 0]), "trailing bytes"),
        (bytes([2, 0, 0x80]), "cut short"),
        (bytes([2, 0, 100, 0, 1]), "more than its"),
        (bytes([2, 0, 2, 0, 1, 0b10]), "too short"),
        (_valid_blob(2) + b"\x00", "trailing data"),
        (_v2_blob(5, [0] * 10 + [1, 1, 1, 0] + [0] + [1, 0, 1] + [0] * 20), "before its parent"),
        (_v2_blob(2, [0] * 4 + [0] + [1] + [0] + [0] * 8 + [1, 0, 1], step_bits=3), "weight out of range"),
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
        "v2-flags",
        "v2-empty-trailing",
        "v2-cut-count",
        "v2-count-too-big",
        "v2-short-stream",
        "v2-trailing",
        "v2-parent-order",
        "v2-negative-weight",
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


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_fuzz_v2_decoder_raises_only_codec_error(body: bytes, ranked: bool) -> None:
    table = TokenTable(np.arange(300)[::-1].copy()) if ranked else None
    try:
        draft = decode_tree(b"\x02" + body, table=table)
    except CodecError:
        return
    draft.validate()
    assert (np.diff(draft.weights) <= 0).all() and (draft.weights >= 0).all()


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255), st.sampled_from([1, 2]))
def test_fuzz_single_byte_corruption(position: int, value: int, version: int) -> None:
    blob = bytearray(_valid_blob(version))
    blob[position % len(blob)] = value
    try:
        draft = decode_tree(bytes(blob))
    except CodecError:
        return
    draft.validate()


@settings(max_examples=80, deadline=None)
@given(
    trees(),
    st.sampled_from(["v1", "v1-plain", "v2", "v2-ranked"]),
    st.sampled_from(["truncate", "extend", "overwrite"]),
    st.integers(0, 10_000),
    st.binary(min_size=1, max_size=8),
)
def test_fuzz_damaged_real_blobs_raise_only_a_clear_codec_error(
    tree: tuple[np.ndarray, np.ndarray, np.ndarray, int], kind: str, damage: str, where: int, junk: bytes
) -> None:
    tokens, parents, weights, vocab = tree
    table = TokenTable(np.unique(np.r_[tokens, 0])) if kind == "v2-ranked" else None
    version = 1 if kind.startswith("v1") else 2
    blob = encode_tree(
        tokens, parents, weights, vocab_size=vocab, version=version, compress=kind != "v1-plain", table=table
    )
    at = where % (len(blob) + 1)
    damaged = {
        "truncate": blob[:at],
        "extend": blob + junk,
        "overwrite": blob[:at] + junk + blob[at + len(junk) :],
    }[damage]
    try:
        draft = decode_tree(damaged, table=table)
    except CodecError as exc:
        assert str(exc).strip(), "a CodecError says what is wrong"
        return
    draft.validate()
    assert (np.diff(draft.weights) <= 0).all() and (draft.weights >= 0).all()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("nodes", [0, 1, 127, 128, 300])
def test_tree_nodes_reads_the_count_from_the_header(version: int, nodes: int) -> None:
    parents = np.arange(-1, nodes - 1, dtype=np.int32)
    blob = encode_tree(np.arange(nodes), parents, np.arange(nodes, 0, -1), vocab_size=1000, version=version)
    assert tree_nodes(blob) == len(decode_tree(blob)) == nodes
    with pytest.raises(CodecError):
        tree_nodes(bytes([3]) + blob[1:])
