"""Key filter: hashes agree between the client's suffix walk and ingest's numpy pass; no stored key is missed."""

from __future__ import annotations

import numpy as np
import pytest
from crest_client.errors import CodecError
from crest_client.keyfilter import KeyFilter, hash_keys, suffix_hashes
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8))
def test_suffix_hashes_match_numpy_key_hashes(tail: list[int]) -> None:
    hashes = suffix_hashes(tail)
    for k in range(1, len(tail) + 1):
        assert hashes[k - 1] == int(hash_keys(np.array([tail[-k:]]))[0])


def test_suffixes_of_different_lengths_hash_apart() -> None:
    assert len(set(suffix_hashes([0, 0, 0, 0]))) == 4


@pytest.mark.parametrize("keys", [1, 100, 50_000], ids=["one", "hundred", "fifty-thousand"])
def test_filter_holds_every_key_and_few_others(keys: int) -> None:
    rng = np.random.default_rng(keys)
    stored = hash_keys(rng.integers(0, 49152, size=(keys, 3)))
    found = KeyFilter.build(stored)
    assert all(h in found for h in stored.tolist())
    others = hash_keys(rng.integers(0, 49152, size=(20_000, 4)))
    rate = np.mean([h in found for h in others.tolist()])
    assert rate < (0.04 if keys >= 100 else 0.2)
    assert found.nbytes() <= max(8, keys * 10 / 8 + 8)
    again = KeyFilter.from_bytes(found.to_bytes())
    assert all(h in again for h in stored.tolist())


@pytest.mark.parametrize(
    "data", [b"", b"CKF1", b"CKF1\x00", b"XXXX" + bytes(8)], ids=["empty", "no-words", "ragged", "magic"]
)
def test_malformed_filter_is_a_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError, match="key filter"):
        KeyFilter.from_bytes(data)
