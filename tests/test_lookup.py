"""The batch lookup's keys: `batch_keys` must probe exactly the keys `Store.candidate_keys` probes, in order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from crest_client.keyfilter import KeyFilter, hash_keys
from crest_client.lookup import batch_keys, batch_sql
from crest_client.store import Store
from hypothesis import given, settings
from hypothesis import strategies as st


@dataclass
class _Info:
    max_n: int
    token_width: int
    vocab_size: int
    key_filter: KeyFilter | None


def _candidate_keys(info: _Info, tail: list[int]) -> list[bytes]:
    holder = Store.__new__(Store)
    holder.info = info  # type: ignore[assignment]
    return holder.candidate_keys(tail)


tails = st.lists(st.lists(st.integers(min_value=-1, max_value=300), max_size=6), max_size=12)


@settings(max_examples=80, deadline=None)
@given(tails=tails, max_n=st.integers(1, 5), stored_share=st.integers(0, 4), filtered=st.booleans())
def test_batch_keys_equal_candidate_keys(tails: list[list[int]], max_n: int, stored_share: int, filtered: bool) -> None:
    grams = [tuple(t[-k:]) for t in tails for k in range(1, min(len(t), max_n) + 1) if k and t and min(t) >= 0]
    stored = [g for i, g in enumerate(grams) if stored_share and i % stored_share == 0]
    hashes = np.array([int(hash_keys(np.array([g]))[0]) for g in stored] or [1], dtype=np.uint64)
    info = _Info(max_n, 2, 256, KeyFilter.build(hashes) if filtered else None)
    index, keys = batch_keys([t[-max_n:] for t in tails], info)
    expected = [(i, key) for i, t in enumerate(tails) if t for key in _candidate_keys(info, t)]
    assert list(zip(index, keys, strict=True)) == expected


def test_batch_sql_has_one_part_per_version() -> None:
    assert batch_sql([7]).count("crest_ngrams_s7") == 1
    both = batch_sql([7, 9])
    assert "crest_ngrams_s9" in both and both.count("UNION ALL") == 1 and both.count("%s") == 4
