"""A compact filter of a store's keys, so the client probes only suffix lengths that may be stored.

Keys are hashed from their last token backwards (`h = mix((h ^ token) * MUL)`), so one pass over a context's
tail yields the hash of every suffix, and ingest hashes all keys of one length with a few numpy operations.
The filter is a blocked Bloom filter: each key sets four bits of one 64-bit word (the word chosen by the high
half of its hash, the bits by the low 24 bits), about 10 bits per key, so a lookup is one word read in Python
and a key that is not stored passes with about 1-2 % probability. A filter never misses a stored key, so
skipping the suffix lengths it rules out never changes which suffix a lookup finds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from crest_client.errors import CodecError

SEED = 0x9E3779B97F4A7C15
MUL = 0xBF58476D1CE4E5B9
_M64 = (1 << 64) - 1
_MAGIC = b"CKF1"


def suffix_hashes(tail: Sequence[int]) -> list[int]:
    """Return the hashes of the tail's suffixes: item k - 1 hashes the last k tokens."""
    h, out = SEED, []
    for token in reversed(tail):
        h = ((h ^ token) * MUL) & _M64
        h ^= h >> 31
        out.append(h)
    return out


def hash_keys(grams: np.ndarray) -> np.ndarray:
    """Return the hash of each row of `grams` ([K, n] token ids), as `suffix_hashes` computes it."""
    grams = np.asarray(grams)
    h = np.full(grams.shape[0], SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(grams.shape[1] - 1, -1, -1):
            h = (h ^ grams[:, j].astype(np.uint64)) * np.uint64(MUL)
            h ^= h >> np.uint64(31)
    return h


def suffix_hashes_many(tails: np.ndarray) -> np.ndarray:
    """Return the suffix hashes of many right-aligned tails ([B, n] ids): column k - 1 hashes the last k tokens."""
    tails = np.asarray(tails)
    out = np.empty(tails.shape, dtype=np.uint64)  # [B, n]
    h = np.full(tails.shape[0], SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(tails.shape[1]):
            h = (h ^ tails[:, -1 - k].astype(np.uint64)) * np.uint64(MUL)
            h ^= h >> np.uint64(31)
            out[:, k] = h
    return out


class KeyFilter:
    """A blocked Bloom filter over key hashes."""

    def __init__(self, words: array) -> None:
        if len(words) == 0:
            raise CodecError("a key filter has at least one word")
        self._words = words
        self._size = len(words)

    @classmethod
    def build(cls, hashes: np.ndarray, *, bits_per_key: float = 10.0) -> KeyFilter:
        """Return a filter holding every hash in `hashes` ([K] uint64)."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        size = max(1, int(np.ceil(hashes.shape[0] * bits_per_key / 64)))
        words = np.zeros(size, dtype=np.uint64)
        np.bitwise_or.at(words, _word_index(hashes, size), _bit_mask(hashes))
        return cls(array("Q", words.astype("<u8").tobytes()))

    def __contains__(self, h: int) -> bool:
        mask = (1 << (h & 63)) | (1 << ((h >> 6) & 63)) | (1 << ((h >> 12) & 63)) | (1 << ((h >> 18) & 63))
        return self._words[((h >> 32) * self._size) >> 32] & mask == mask

    def __len__(self) -> int:
        return self._size

    def contains_many(self, hashes: np.ndarray) -> np.ndarray:
        """Return, for each hash in `hashes` (any shape, uint64), whether the filter may hold it."""
        words = np.frombuffer(self._words, dtype=np.uint64)
        flat = np.asarray(hashes, dtype=np.uint64).reshape(-1)
        mask = _bit_mask(flat)
        return ((words[_word_index(flat, self._size)] & mask) == mask).reshape(np.shape(hashes))

    def nbytes(self) -> int:
        """Return the filter's size in bytes."""
        return 8 * self._size

    def to_bytes(self) -> bytes:
        """Return the filter as a magic tag and little-endian u64 words."""
        return _MAGIC + np.frombuffer(self._words.tobytes(), dtype=np.uint64).astype("<u8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> KeyFilter:
        """Read a filter written by `to_bytes`; raise `CodecError` when it is malformed."""
        data = bytes(data)
        if data[:4] != _MAGIC or (len(data) - 4) % 8 or len(data) < 12:
            raise CodecError("key filter is malformed")
        return cls(array("Q", np.frombuffer(data, dtype="<u8", offset=4).astype(np.uint64).tobytes()))


def _word_index(hashes: np.ndarray, size: int) -> np.ndarray:
    return ((hashes >> np.uint64(32)) * np.uint64(size)) >> np.uint64(32)


def _bit_mask(hashes: np.ndarray) -> np.ndarray:
    one, mask = np.uint64(1), np.zeros(hashes.shape[0], dtype=np.uint64)
    for shift in (0, 6, 12, 18):
        mask |= one << ((hashes >> np.uint64(shift)) & np.uint64(63))
    return mask
