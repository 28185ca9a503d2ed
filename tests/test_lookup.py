"""The lookup's keys: `candidate_keys` probes exactly the suffixes the key filter may hold, longest first.

A single lookup is a batch of one, so the one rule is checked against keys built from first principles: each
suffix's big-endian ids, kept when the filter (queried through numpy's `hash_keys`/`contains_many`) may hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from crest_client.keyfilter import KeyFilter, hash_keys
from crest_client.lookup import batch_sql, candidate_keys, lookup_sql
from crest_client.store import Store
from hypothesis import given, settings
from hypothesis import strategies as st


@dataclass
class _Info:
    max_n: int
    token_width: int
    vocab_size: int
    key_filter: KeyFilter | None


def _reference_keys(info: _Info, tail: list[int]) -> list[bytes]:
    tail = tail[-info.max_n :]
    while tail and not all(0 <= t < info.vocab_size for t in tail):  # suffixes after the last unknown id
        tail = tail[1:]
    if not tail:
        return []
    keys = []
    for k in range(len(tail), 0, -1):
        gram = np.array([tail[-k:]], dtype=np.int64)
        if info.key_filter is None or bool(info.key_filter.contains_many(hash_keys(gram))[0]):
            keys.append(gram.astype(">u2").tobytes())
    return keys


def _store_keys(info: _Info, tail: list[int]) -> list[bytes]:
    holder = Store.__new__(Store)
    holder.info = cast(Any, info)  # a stand-in with the fields the keys read
    return holder.candidate_keys(tail)


tails = st.lists(st.lists(st.integers(min_value=-1, max_value=300), max_size=6), max_size=12)


@settings(max_examples=80, deadline=None)
@given(tails=tails, max_n=st.integers(1, 5), stored_share=st.integers(0, 4), filtered=st.booleans())
def test_candidate_keys_are_the_filtered_suffixes_longest_first(
    tails: list[list[int]], max_n: int, stored_share: int, filtered: bool
) -> None:
    grams = [tuple(t[-k:]) for t in tails for k in range(1, min(len(t), max_n) + 1) if k and t and min(t) >= 0]
    stored = [g for i, g in enumerate(grams) if stored_share and i % stored_share == 0]
    hashes = np.array([int(hash_keys(np.array([g]))[0]) for g in stored] or [1], dtype=np.uint64)
    info = _Info(max_n, 2, 256, KeyFilter.build(hashes) if filtered else None)
    index, keys = candidate_keys(tails, info)
    expected = [(i, key) for i, t in enumerate(tails) for key in _reference_keys(info, t)]
    assert list(zip(index, keys, strict=True)) == expected
    assert [_store_keys(info, t) for t in tails] == [_reference_keys(info, t) for t in tails]  # a batch of one
    looked_up = {
        tuple(t[-k:]) for t in tails for k in range(1, min(len(t), max_n) + 1) if all(0 <= x < 256 for x in t[-k:])
    }
    if filtered:  # a stored suffix of a tail inside the vocabulary always passes
        assert all(np.array(g, dtype=np.int64).astype(">u2").tobytes() in keys for g in stored if g in looked_up)


def test_batch_sql_has_one_part_per_version() -> None:
    assert batch_sql([7]).count("crest_ngrams_s7") == 1
    both = batch_sql([7, 9])
    assert "crest_ngrams_s9" in both and both.count("UNION ALL") == 1 and both.count("%s") == 4


def test_a_single_context_in_one_version_is_probed_longest_first_and_stops_at_the_first_hit() -> None:
    name, single = lookup_sql([7], 3)
    assert single.count("crest_ngrams_s7") == 3 and single.endswith("LIMIT 1") and name.endswith("_3")
    assert "LIMIT" not in lookup_sql([7], 3, every=True)[1]
    assert lookup_sql([7, 9], 3)[1] == batch_sql([7, 9]) and lookup_sql([7], None)[1] == batch_sql([7])
