"""The tree blob format: how a draft token tree is stored in one `bytea` value.

Version 1 layout: a header — version (u8), flags (u8), node count (u8, or u16 little-endian when flag bit 7 is
set) — then the payload: token ids and parent indices plus one (0 = child of the root), each a little-endian
array in the narrowest unsigned width that holds its largest value, then the weights. Weights never increase
along the node order, so when they need a wide width only a leading run does: the payload then holds that
run's length (as wide as the node count), the run in the wide width, and the remaining weights as u8. Flag
bits: 0 = payload is an lz4 block (kept only when smaller), 1-2 = token width code, 3-4 = parent width code,
5-6 = weight width code (codes 0..3 mean 1, 2, 4, 8 bytes), 7 = the counts are u16. Decoding checks every
field and raises `CodecError` on anything malformed, so a corrupted row can never crash a reader.
"""

from __future__ import annotations

import struct

import lz4.block
import numpy as np

from crest_client.draft import Draft
from crest_client.errors import CodecError

VERSION = 1
MAX_NODES = 0xFFFF
_HEADER = struct.Struct("<BB")
_COUNT = (struct.Struct("<B"), struct.Struct("<H"))
_LONG = 0x80
_WIDTHS = (1, 2, 4, 8)
_DTYPES = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
_LZ4 = 0x01
_ARANGE = np.arange(MAX_NODES + 1, dtype=np.int32)


def width_code(max_value: int) -> int:
    """Return the code of the narrowest unsigned width that holds `max_value`."""
    for code, width in enumerate(_WIDTHS):
        if max_value < (1 << (8 * width)):
            return code
    raise CodecError(f"value {max_value} does not fit in 64 bits")


def token_width(vocab_size: int) -> int:
    """Return the narrowest width in bytes for token ids of a vocabulary of `vocab_size` entries."""
    return _WIDTHS[width_code(max(vocab_size - 1, 0))]


def encode_tree(
    tokens: np.ndarray, parents: np.ndarray, weights: np.ndarray, *, vocab_size: int, compress: bool = True
) -> bytes:
    """Encode one tree (parents before children, -1 = root) into a version-1 blob."""
    count = int(tokens.shape[0])
    if count > MAX_NODES:
        raise CodecError(f"a tree has {count} nodes, more than the format's {MAX_NODES}")
    tcode = width_code(max(vocab_size - 1, 0))
    pcode = width_code(count)
    wmax = int(weights.max()) if count else 0
    if count and (int(weights.min()) < 0 or int(tokens.min()) < 0):
        raise CodecError("negative token id or weight")
    wcode = width_code(wmax)
    counter = _COUNT[count > 0xFF]
    weights = np.asarray(weights)
    parts = [
        np.asarray(tokens).astype(_DTYPES[tcode], copy=False).tobytes(),
        (np.asarray(parents).astype(np.int64) + 1).astype(_DTYPES[pcode]).tobytes(),
    ]
    if wcode:
        wide = int(np.count_nonzero(weights > 0xFF))  # a leading run, as weights never increase
        parts += [counter.pack(wide), weights[:wide].astype(_DTYPES[wcode]).tobytes()]
        parts.append(weights[wide:].astype(_DTYPES[0]).tobytes())
    else:
        parts.append(weights.astype(_DTYPES[0]).tobytes())
    payload = b"".join(parts)
    flags = (tcode << 1) | (pcode << 3) | (wcode << 5) | (_LONG if count > 0xFF else 0)
    if compress and len(payload) > 16:
        packed = lz4.block.compress(payload, store_size=False, mode="high_compression")
        if len(packed) < len(payload):
            payload, flags = packed, flags | _LZ4
    return _HEADER.pack(VERSION, flags) + counter.pack(count) + payload


def decode_tree(blob: bytes | memoryview, *, n: int = 0) -> Draft:
    """Decode a blob into a `Draft`; raise `CodecError` when it is malformed."""
    data = blob if isinstance(blob, bytes) else bytes(blob)
    if len(data) < _HEADER.size:
        raise CodecError(f"tree blob of {len(data)} bytes is shorter than its header")
    version, flags = _HEADER.unpack_from(data)
    if version != VERSION:
        raise CodecError(f"tree blob has unknown format version {version} (this client reads {VERSION})")
    counter = _COUNT[(flags & _LONG) >> 7]
    if len(data) < _HEADER.size + counter.size:
        raise CodecError(f"tree blob of {len(data)} bytes is shorter than its header")
    (count,) = counter.unpack_from(data, _HEADER.size)
    tdt, pdt, wdt = _DTYPES[(flags >> 1) & 3], _DTYPES[(flags >> 3) & 3], _DTYPES[(flags >> 5) & 3]
    t_end = count * tdt.itemsize
    p_end = t_end + count * pdt.itemsize
    payload = data[_HEADER.size + counter.size :]
    if flags & _LZ4:
        try:
            payload = lz4.block.decompress(payload, uncompressed_size=p_end + counter.size + count * wdt.itemsize)
        except Exception as exc:  # lz4 raises LZ4BlockError and others on garbage
            raise CodecError(f"tree blob's lz4 payload is corrupt: {exc}") from None
    wide = 0
    if wdt.itemsize > 1:
        if len(payload) < p_end + counter.size:
            raise CodecError(f"tree blob payload of {len(payload)} bytes is too short for {count} nodes")
        (wide,) = counter.unpack_from(payload, p_end)
        if wide > count:
            raise CodecError("tree blob has more wide weights than nodes")
        p_end += counter.size
    size = p_end + wide * wdt.itemsize + (count - wide)
    if len(payload) != size:
        raise CodecError(f"tree blob payload has {len(payload)} bytes, expected {size} for {count} nodes")
    tokens = np.frombuffer(payload, tdt, count, 0).astype(np.int64)
    parents = np.frombuffer(payload, pdt, count, t_end).astype(np.int32) - 1
    if wide:
        weights = np.concatenate(
            (
                np.frombuffer(payload, wdt, wide, p_end).astype(np.int64),
                np.frombuffer(payload, _DTYPES[0], count - wide, p_end + wide * wdt.itemsize),
            )
        )
    else:
        weights = np.frombuffer(payload, _DTYPES[0], count, p_end).astype(np.int64)
    if count:
        if (parents >= _ARANGE[:count]).any():
            raise CodecError("tree blob has a node before its parent")
        if wdt.itemsize == 8 and int(weights.min()) < 0:
            raise CodecError("tree blob has a weight out of range")
        if (np.diff(weights.astype(np.int64)) > 0).any():
            raise CodecError("tree blob's weights increase along the node order")
    return Draft(tokens, parents, weights, n)
