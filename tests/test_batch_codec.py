"""Decoding a batch of blobs at once must give exactly what decoding each blob alone gives, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from crest_client.batch_codec import decode_trees
from crest_client.codec import TokenTable, decode_tree, encode_tree
from crest_client.draft import Draft
from crest_client.errors import CodecError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fix_drafts import trees


def _same(a: Draft, b: Draft) -> bool:
    fields = ("tokens", "parents", "weights")
    return all(getattr(a, f).tolist() == getattr(b, f).tolist() for f in fields) and a.n == b.n


def _one_by_one(blobs: list[bytes], ns: list[int], table: TokenTable | None) -> list[Draft | None]:
    out: list[Draft | None] = []
    for blob, n in zip(blobs, ns, strict=True):
        try:
            out.append(decode_tree(blob, n=n, table=table))
        except CodecError:
            out.append(None)
    return out


_PARENTS_PAST_THE_END = np.zeros(128, dtype=np.int32)
_PARENTS_PAST_THE_END[[0, 2, 14, 73]] = [-1, 1, 13, 70]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(trees(), min_size=1, max_size=8),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
)
@example(  # a flipped byte made a 128-node blob's fields point past the buffer: an IndexError, not CodecError
    batch=[(np.zeros(128, dtype=np.int64), _PARENTS_PAST_THE_END, np.ones(128, dtype=np.int64), 2)],
    ranked=False,
    flips=[(3957, 37)],
)
def test_batch_equals_one_by_one(batch: list, ranked: bool, flips: list[tuple[int, int]]) -> None:
    vocab = min(v for *_, v in batch)
    batch = [(t % vocab, p, w, vocab) for t, p, w, _ in batch]
    table = None
    if ranked:
        ids = sorted({int(t) for tokens, *_ in batch for t in tokens} | {0, vocab - 1})
        table = TokenTable(np.array(ids[::-1], dtype=np.int64))
    blobs = [encode_tree(t, p, w, vocab_size=vocab, table=table) for t, p, w, _ in batch]
    for where, byte in flips:  # corrupt a byte of some blob: both decoders must agree (or both refuse)
        j = where % len(blobs)
        if blobs[j]:
            data = bytearray(blobs[j])
            data[where % len(data)] = byte
            blobs[j] = bytes(data)
    ns = [i % 5 for i in range(len(blobs))]
    expected = _one_by_one(blobs, ns, table)
    if any(d is None for d in expected):
        with pytest.raises(CodecError):
            decode_trees(blobs, ns, table=table)
        return
    got = decode_trees(blobs, ns, table=table)
    assert len(got) == len(expected) and all(_same(a, b) for a, b in zip(got, expected, strict=True) if b)


def test_batch_mixes_formats_and_empty_trees() -> None:
    tokens, parents, weights = np.array([5, 6, 7]), np.array([-1, 0, 0], dtype=np.int32), np.array([9, 4, 4])
    blobs = [
        encode_tree(tokens, parents, weights, vocab_size=100),
        encode_tree(tokens, parents, weights, vocab_size=100, version=1),
        encode_tree(tokens[:0], parents[:0], weights[:0], vocab_size=100),
    ]
    got = decode_trees(blobs, [1, 2, 3])
    assert [d.tokens.tolist() for d in got] == [[5, 6, 7], [5, 6, 7], []] and [d.n for d in got] == [1, 2, 3]
