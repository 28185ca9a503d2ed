"""The tree blob format: how a draft token tree is stored in one `bytea` value.

Version 2 (written by default) is bit-packed; fields sit in one little-endian bit stream after a byte
header: version (2), flags (bit 0: tokens are ranks in the store's `TokenTable`; bits 1-5: the width in bits
of the widest token class), node count (LEB128), the first weight (LEB128) and the width in bits of weight
steps. The stream holds, for nodes 1..count-1, a chain bit (1 = the parent is the previous node); for every
other node i its parent plus one in the fewest bits that hold i - 1; a 2-bit class per token and the token
(its rank, or its id) in 4, 8, 12 or the widest class's bits, offset by the classes before it; for nodes
1..count-1 a bit saying the weight drops there, and each drop minus one in the step width. Trees are stored
with equal-weight chains contiguous, so most parents cost one bit, and common tokens (low ranks) take 6 or 10
bits. Version 1 (byte arrays in the narrowest widths, lz4 when smaller) is still read and can be written.
Decoding checks every field and raises `CodecError` on anything malformed, so a corrupted row can never crash
a reader.
"""

from __future__ import annotations

import struct

import lz4.block
import numpy as np

from crest_client._format import CLASS_BASE, CLASS_BITS, MASKS, MAX_NODES, PARENT_BITS, RANKED
from crest_client.draft import Draft, empty_draft
from crest_client.errors import CodecError

VERSION = 2
_HEADER = struct.Struct("<BB")
_COUNT = (struct.Struct("<B"), struct.Struct("<H"))
_LONG = 0x80
_WIDTHS = (1, 2, 4, 8)
_DTYPES = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
_LZ4 = 0x01
_ARANGE = np.arange(MAX_NODES + 1, dtype=np.int32)
_PAD = bytes(8)  # after the stream, so a 64-bit window can start at its last byte
_CLASS_LUT = (np.arange(256)[:, None] >> np.array([0, 2, 4, 6])) & 3  # [256, 4] the 2-bit classes in a byte
_CLASS_LUTS: dict[int, np.ndarray] = {}  # widest -> [256, 4, 2] token width and offset of each class in a byte
_PARENTS = np.arange(-1, MAX_NODES, dtype=np.int32)  # every node a child of the previous one
_MAX_STEP_BITS = 57  # a value and its bit offset fit one 64-bit window


def width_code(max_value: int) -> int:
    """Return the code of the narrowest unsigned width that holds `max_value`."""
    for code, width in enumerate(_WIDTHS):
        if max_value < (1 << (8 * width)):
            return code
    raise CodecError(f"value {max_value} does not fit in 64 bits")


def token_width(vocab_size: int) -> int:
    """Return the narrowest width in bytes for token ids of a vocabulary of `vocab_size` entries."""
    return _WIDTHS[width_code(max(vocab_size - 1, 0))]


class TokenTable:
    """Token ids in rank order (most frequent first): blobs store ranks, so common tokens take few bits."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [R] token id of each rank
        if self.tokens.ndim != 1 or (self.tokens.size and int(self.tokens.min()) < 0):
            raise CodecError("a token table holds non-negative token ids in one dimension")
        if np.unique(self.tokens).shape[0] != self.tokens.shape[0]:
            raise CodecError("a token table lists a token twice")
        self._ranks: np.ndarray | None = None
        self.widest = max(0, len(self.tokens) - 1 - int(CLASS_BASE[3])).bit_length()  # class 3's width

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> TokenTable:
        """Rank the tokens with a non-zero count, most frequent first, ties by smaller id."""
        counts = np.asarray(counts)
        present = np.flatnonzero(counts > 0)
        return cls(present[np.lexsort((present, -counts[present].astype(np.int64)))])

    def ranks_of(self, tokens: np.ndarray) -> np.ndarray:
        """Return the rank of each token; raise `CodecError` for a token the table lacks."""
        if self._ranks is None:
            order = np.argsort(self.tokens, kind="stable")
            self._ranks = np.stack((self.tokens[order], order))  # [2, R] sorted ids, their ranks
        ids, ranks = self._ranks
        tokens = np.asarray(tokens, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, tokens), max(0, ids.shape[0] - 1))
        if tokens.size and (ids.shape[0] == 0 or (ids[at] != tokens).any()):
            raise CodecError("a tree token is missing from the store's token table")
        return ranks[at]

    def to_bytes(self) -> bytes:
        """Return the table as little-endian u32 token ids."""
        return self.tokens.astype("<u4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> TokenTable:
        """Read a table written by `to_bytes`; raise `CodecError` when it is malformed."""
        if len(data) % 4:
            raise CodecError(f"token table of {len(data)} bytes is not a whole number of u32 ids")
        return cls(np.frombuffer(bytes(data), dtype="<u4").astype(np.int64))


def encode_tree(
    tokens: np.ndarray,
    parents: np.ndarray,
    weights: np.ndarray,
    *,
    vocab_size: int,
    table: TokenTable | None = None,
    version: int = VERSION,
    compress: bool = True,
) -> bytes:
    """Encode one tree (parents before children, -1 = root, weights non-increasing) into a blob."""
    tokens = np.asarray(tokens, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.int64)
    count = int(tokens.shape[0])
    if count > MAX_NODES:
        raise CodecError(f"a tree has {count} nodes, more than the format's {MAX_NODES}")
    if parents.shape != (count,) or weights.shape != (count,):
        raise CodecError("tree arrays differ in length")
    if count and (int(weights.min()) < 0 or int(tokens.min()) < 0):
        raise CodecError("negative token id or weight")
    if count and ((parents >= np.arange(count)).any() or (parents < -1).any()):
        raise CodecError("a tree node comes before its parent")
    if count and (np.diff(weights) > 0).any():
        raise CodecError("tree weights increase along the node order")
    if version == 1:
        if table is not None:
            raise CodecError("format version 1 stores token ids, not ranks")
        return _encode_v1(tokens, parents, weights, vocab_size=vocab_size, compress=compress)
    if version != 2:
        raise CodecError(f"cannot write tree format version {version}")
    return _encode_v2(tokens, parents, weights, table)


def decode_tree(blob: bytes | memoryview, *, n: int = 0, table: TokenTable | None = None) -> Draft:
    """Decode a blob into a `Draft`; raise `CodecError` when it is malformed."""
    data = blob if isinstance(blob, bytes) else bytes(blob)
    if len(data) < _HEADER.size:
        raise CodecError(f"tree blob of {len(data)} bytes is shorter than its header")
    version = data[0]
    if version == 2:
        return _decode_v2(data, n, table)
    if version == 1:
        return _decode_v1(data, n)
    raise CodecError(f"tree blob has unknown format version {version} (this client reads 1 and 2)")


def tree_nodes(blob: bytes | memoryview) -> int:
    """Return a blob's node count from its header, without decoding it; raise `CodecError` when it is malformed."""
    data = blob if isinstance(blob, bytes) else bytes(blob)
    if len(data) < _HEADER.size or data[0] not in (1, 2):
        raise CodecError("tree blob is shorter than its header or of an unknown format version")
    if data[0] == 2:
        return _read_varint(data, 2)[0]
    counter = _COUNT[(data[1] & _LONG) >> 7]
    if len(data) < _HEADER.size + counter.size:
        raise CodecError(f"tree blob of {len(data)} bytes is shorter than its header")
    return int(counter.unpack_from(data, _HEADER.size)[0])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise CodecError("tree blob header is cut short or has an overlong number")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _pack(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Return the low `widths[i]` bits of each value, LSB first, concatenated: [sum(widths)] uint8."""
    top = int(widths.max()) if widths.size else 0
    if top == 0:
        return np.zeros(0, dtype=np.uint8)
    shifts = np.arange(top, dtype=np.int64)
    bits = (values[:, None] >> shifts) & 1  # [K, top]
    return bits[shifts < widths[:, None]].astype(np.uint8)


def _class_lut(widest: int) -> np.ndarray:
    """Return the token width and offset of each of the four 2-bit classes of every byte: [256, 4, 2]."""
    lut = _CLASS_LUTS.get(widest)
    if lut is None:
        widths = np.array([*CLASS_BITS, widest], dtype=np.int64)
        lut = _CLASS_LUTS[widest] = np.stack((widths[_CLASS_LUT], CLASS_BASE[_CLASS_LUT]), axis=-1)
    return lut


def _encode_v2(tokens: np.ndarray, parents: np.ndarray, weights: np.ndarray, table: TokenTable | None) -> bytes:
    count = int(tokens.shape[0])
    if table is not None:
        ranks, widest = table.ranks_of(tokens), table.widest
    else:
        ranks = tokens
        widest = max(0, int(ranks.max()) - int(CLASS_BASE[3])).bit_length() if count else 0
    if widest > 0x1F:
        raise CodecError("a token id or rank needs more than 31 bits")
    if count == 0:
        return bytes((2, RANKED if table is not None else 0, 0)) + (b"" if table is not None else b"\x00")
    idx = np.arange(1, count)
    chain = (parents[1:] == idx - 1) & (weights[1:] == weights[:-1])  # [C-1] same run as the previous node
    heads = idx[~chain]  # [H]
    drops = weights[heads - 1] - weights[heads]  # [H] >= 0
    steps = drops[drops > 0] - 1
    step_bits = int(steps.max()).bit_length() if steps.size else 0
    if step_bits > _MAX_STEP_BITS:
        raise CodecError(f"a tree weight step needs more than {_MAX_STEP_BITS} bits")
    cls = np.searchsorted(CLASS_BASE, ranks, side="right") - 1  # [C] 0..3
    bits = np.concatenate(
        (
            _pack(cls, np.full(count, 2, dtype=np.int64)),
            chain.astype(np.uint8),
            (drops > 0).astype(np.uint8),
            _pack(parents[heads] + 1, PARENT_BITS[heads]),
            _pack(ranks - CLASS_BASE[cls], np.array([*CLASS_BITS, widest], dtype=np.int64)[cls]),
            _pack(steps, np.full(steps.shape[0], step_bits, dtype=np.int64)),
        )
    )
    flags = (RANKED if table is not None else 0) | (step_bits << 1)
    head = bytes((2, flags)) + _varint(count) + (b"" if table is not None else bytes((widest,)))
    return head + _varint(int(weights[0])) + np.packbits(bits, bitorder="little").tobytes()


def _decode_v2(data: bytes, n: int, table: TokenTable | None) -> Draft:
    """Decode with a fixed, small number of numpy calls: their count, not the node count, sets the cost."""
    flags = data[1]
    if flags & 0x80:
        raise CodecError("tree blob has unknown flags set")
    step_bits = (flags >> 1) & 0x3F
    count, pos = (data[2], 3) if len(data) > 2 and data[2] < 0x80 else _read_varint(data, 2)
    if flags & RANKED:
        if table is None:
            raise CodecError("tree blob stores token ranks; decoding it needs the store's token table")
        widest = table.widest
    else:
        if pos >= len(data):
            raise CodecError("tree blob header is cut short")
        widest, pos = data[pos], pos + 1
    if count == 0:
        if pos != len(data) or step_bits:
            raise CodecError("tree blob of an empty tree has trailing bytes")
        return empty_draft(n)
    if count > MAX_NODES or 7 * count > 8 * (len(data) - pos) + 2:  # >= 2 class, 4 token, 1 chain bits a node
        raise CodecError(f"tree blob claims {count} nodes, more than its {len(data)} bytes can hold")
    first, pos = (data[pos], pos + 1) if data[pos] < 0x80 else _read_varint(data, pos)
    if step_bits > _MAX_STEP_BITS or widest > 0x1F or first >= 1 << 62:
        raise CodecError("tree blob has a field out of range")
    size = len(data) - pos  # stream bytes
    buf = data + _PAD
    stream = np.frombuffer(buf, np.uint8, size + 8, pos)  # [B + 8]
    quads = stream[: (count + 3) >> 2]  # the bytes of the 2-bit classes, four a byte
    chain_at = 2 * count  # chain bits, then drop bits: at most 2C - 2 bits
    bits = np.unpackbits(stream[chain_at >> 3 : (3 * count + 6) >> 3], bitorder="little")[chain_at & 7 :]
    heads = (bits[: count - 1] == 0).nonzero()[0] + 1  # [H] nodes whose parent is not the previous node
    h = heads.shape[0]
    whole = int.from_bytes(data[pos:], "little")  # the stream as one integer, for the few per-drop fields
    dropped = (whole >> (3 * count - 1)) & ((1 << h) - 1)  # bit j: the weight drops at heads[j]
    drops = dropped.bit_count()
    lut = _CLASS_LUTS.get(widest)
    lut = _class_lut(widest) if lut is None else lut
    classes = lut.take(quads, axis=0).reshape(-1, 2)[:count]  # [C, 2] token width, token offset
    widths = np.concatenate(((3 * count - 1 + h,), PARENT_BITS[heads], classes[:, 0]))
    ends = widths.cumsum()  # [1 + H + C]: where the parents, then the tokens start, then the steps' offset
    steps_at = int(ends[-1])
    end = steps_at + drops * step_bits
    if end > 8 * size:
        raise CodecError("tree blob is too short for its fields")
    if size != (end + 7) >> 3 or (end & 7 and data[-1] >> (end & 7)):
        raise CodecError("tree blob has trailing data")
    starts = ends[:-1]  # [H + C]
    # [B + 1] the 64-bit word at each byte of the stream (a 0-bit last field starts at byte B)
    windows = np.ndarray((size + 1,), "<i8", buf, pos, (1,))
    values = (windows[starts >> 3] >> (starts & 7)) & MASKS[widths[1:]]  # width + shift <= 64, so sign bits drop out
    head_parents = values[:h]  # parent + 1
    if np.count_nonzero(head_parents > heads):
        raise CodecError("tree blob has a node before its parent")
    parents = _PARENTS[:count].copy()
    parents.put(heads, head_parents - 1)
    ranks = values[h:] + classes[:, 1]
    if drops:
        mask, level, last, levels, runs = (1 << step_bits) - 1, first, 0, [first], []
        listed = heads.tolist()
        for k in range(drops):  # D is small: a few drops a tree
            low = dropped & -dropped
            dropped ^= low
            at = listed[low.bit_length() - 1]
            runs.append(at - last)
            last = at
            level -= ((whole >> (steps_at + k * step_bits)) & mask) + 1
            levels.append(level)
        if level < 0:
            raise CodecError("tree blob has a weight out of range")
        runs.append(count - last)
        weights = np.array(levels, dtype=np.int64).repeat(runs)
    else:
        weights = np.full(count, first, dtype=np.int64)
    if flags & RANKED:
        assert table is not None
        try:
            tokens = table.tokens.take(ranks)
        except IndexError:
            raise CodecError("tree blob has a token rank beyond the store's token table") from None
    else:
        tokens = ranks
    return Draft(tokens, parents, weights, n)


def _encode_v1(
    tokens: np.ndarray, parents: np.ndarray, weights: np.ndarray, *, vocab_size: int, compress: bool
) -> bytes:
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
    return _HEADER.pack(1, flags) + counter.pack(count) + payload


def _decode_v1(data: bytes, n: int) -> Draft:
    if len(data) < _HEADER.size:
        raise CodecError(f"tree blob of {len(data)} bytes is shorter than its header")
    _, flags = _HEADER.unpack_from(data)
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
