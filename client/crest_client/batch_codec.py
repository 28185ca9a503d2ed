"""Decoding many format-2 tree blobs at once: one set of numpy operations for a whole batch of lookups.

`decode_tree` spends its time in a fixed number of numpy calls per blob, so a server's batch of 64 lookups pays
that fixed cost 64 times. `decode_trees` reads the small headers in Python, lays every blob's bit stream end to
end in one buffer, and extracts the classes, chain bits, parents, tokens and weight steps of all nodes of all
blobs with the same window trick (the 64-bit word at a field's byte, shifted and masked), using per-blob
offsets and segmented sums where the one-blob decoder uses plain ones. Every check of `decode_tree` is made for
the batch as a whole; a blob that fails one, or that is not a plain format-2 blob, is decoded alone by
`decode_tree`, so errors and results are exactly the one-blob decoder's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crest_client._format import CLASS_BASE, MASKS, MAX_NODES, PARENT_BITS, RANKED
from crest_client.codec import TokenTable, decode_tree
from crest_client.draft import Draft

_CLASS_BITS = np.array([4, 8, 12], dtype=np.int64)


def decode_trees(blobs: Sequence[bytes], ns: Sequence[int], *, table: TokenTable | None = None) -> list[Draft]:
    """Decode many blobs (as `decode_tree` would, one by one); raise `CodecError` for the first malformed one."""
    out: list[Draft | None] = [None] * len(blobs)
    batch: list[int] = []
    heads: list[tuple[int, int, int, int, int]] = []  # (count, stream start, first weight, step bits, widest)
    for j, blob in enumerate(blobs):
        header = _header(blob, table)
        if header is None:
            out[j] = decode_tree(blob, n=int(ns[j]), table=table)
        else:
            batch.append(j)
            heads.append(header)
    if batch:
        bad = _decode_batch([blobs[j] for j in batch], [int(ns[j]) for j in batch], heads, table, out, batch)
        for j in bad:  # the one-blob decoder raises the precise error
            out[j] = decode_tree(blobs[j], n=int(ns[j]), table=table)
    return [d for d in out if d is not None]


def _header(blob: bytes, table: TokenTable | None) -> tuple[int, int, int, int, int] | None:
    """Return a plain format-2 blob's (count, stream start, first weight, step bits, widest), else None."""
    if len(blob) < 4 or blob[0] != 2 or blob[1] & 0x80:
        return None
    flags = blob[1]
    if bool(flags & RANKED) != (table is not None) or blob[2] >= 0x80 or blob[2] == 0:
        return None  # unranked blobs with a table, long counts, empty trees: the one-blob path
    count, pos = blob[2], 3
    widest = table.widest if table is not None else blob[pos]
    pos += 0 if table is not None else 1
    if pos >= len(blob) or blob[pos] >= 0x80:
        return None
    first, pos = blob[pos], pos + 1
    step_bits = (flags >> 1) & 0x3F
    if step_bits > 57 or widest > 0x1F or 7 * count > 8 * (len(blob) - pos) + 2 or count > MAX_NODES:
        return None
    return count, pos, first, step_bits, widest


def _segment_exclusive(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Return, per element, the sum of the earlier elements of its segment (segments of `sizes`, in order)."""
    total = np.cumsum(values) - values
    starts = np.cumsum(sizes) - sizes
    base = np.zeros(sizes.shape[0], dtype=np.int64)
    filled = sizes > 0
    base[filled] = total[starts[filled]]
    return total - np.repeat(base, sizes)


def _decode_batch(
    blobs: list[bytes],
    ns: list[int],
    heads: list[tuple[int, int, int, int, int]],
    table: TokenTable | None,
    out: list[Draft | None],
    where: list[int],
) -> list[int]:
    """Decode the batch into `out[where[b]]`; return the indices (into `out`) of blobs that failed a check."""
    meta = np.array(heads, dtype=np.int64)  # [M, 5]
    counts, starts, firsts, step_bits, widest = meta.T
    streams = [blob[start:] for blob, (_, start, _, _, _) in zip(blobs, heads, strict=True)]
    sizes = np.fromiter((len(s) for s in streams), dtype=np.int64, count=len(streams))  # [M] stream bytes
    base = 8 * (np.cumsum(sizes) - sizes)  # [M] bit offset of each stream in the buffer
    buf = b"".join(streams) + bytes(8)
    windows = np.ndarray((len(buf) - 7,), "<i8", buf, 0, (1,))  # the 64-bit word at each byte

    last_window = windows.shape[0] - 1

    def read(bits: np.ndarray, widths: np.ndarray) -> np.ndarray:
        # a corrupt blob's fields can point past the buffer: read garbage there, its end check marks it bad
        return (windows[np.minimum(bits >> 3, last_window)] >> (bits & 7)) & MASKS[widths]

    m = counts.shape[0]
    blob = np.repeat(np.arange(m), counts)  # [C] blob of each node
    node = np.arange(blob.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)  # [C] index within its blob
    origin = base[blob]
    classes = read(origin + 2 * node, np.full(node.shape[0], 2))
    chained = read(origin + 2 * counts[blob] + node - 1, np.ones_like(node))  # garbage at node 0, ignored
    is_head = (node > 0) & (chained == 0)
    head_blob, head_node = blob[is_head], node[is_head]
    h = np.bincount(head_blob, minlength=m)  # [M] heads per blob
    head_rank = _segment_exclusive(np.ones_like(head_node), h)
    dropped = read(base[head_blob] + 3 * counts[head_blob] - 1 + head_rank, np.ones_like(head_node))
    parent_bits = PARENT_BITS[head_node]
    parents_at = 3 * counts - 1 + h  # [M] bit where the parents start, within the stream
    head_values = read(
        base[head_blob] + parents_at[head_blob] + _segment_exclusive(parent_bits, h), parent_bits
    )  # parent + 1
    token_bits = np.where(classes == 3, widest[blob], _CLASS_BITS[np.minimum(classes, 2)])
    tokens_at = parents_at + np.bincount(head_blob, weights=parent_bits, minlength=m).astype(np.int64)
    ranks = read(origin + tokens_at[blob] + _segment_exclusive(token_bits, counts), token_bits) + CLASS_BASE[classes]
    steps_at = tokens_at + np.bincount(blob, weights=token_bits, minlength=m).astype(np.int64)
    drops = np.bincount(head_blob, weights=dropped, minlength=m).astype(np.int64)  # [M]
    end = steps_at + drops * step_bits
    drop_blob = head_blob[dropped == 1]
    drop_rank = _segment_exclusive(np.ones_like(drop_blob), drops)
    steps = read(base[drop_blob] + steps_at[drop_blob] + drop_rank * step_bits[drop_blob], step_bits[drop_blob])

    last = np.array([s[-1] for s in streams], dtype=np.int64)
    ok = (end <= 8 * sizes) & (sizes == (end + 7) >> 3) & (((end & 7) == 0) | ((last >> (end & 7)) == 0))
    late = np.bincount(head_blob, weights=head_values > head_node, minlength=m) > 0
    ok &= ~late
    delta = np.zeros(blob.shape[0], dtype=np.int64)
    delta[np.nonzero(is_head)[0][dropped == 1]] = steps + 1
    weights = np.repeat(firsts, counts) - (_segment_exclusive(delta, counts) + delta)
    below = np.bincount(blob, weights=weights < 0, minlength=m) > 0
    ok &= ~below
    parents = (node - 1).astype(np.int32)
    parents[is_head] = head_values - 1
    if table is not None:
        beyond = np.bincount(blob, weights=ranks >= len(table.tokens), minlength=m) > 0
        ok &= ~beyond
        tokens = table.tokens.take(np.minimum(ranks, max(0, len(table.tokens) - 1))) if len(table.tokens) else ranks
    else:
        tokens = ranks
    bounds = np.cumsum(counts) - counts
    bad = []
    for b in range(m):
        if not ok[b]:
            bad.append(where[b])
            continue
        lo, hi = int(bounds[b]), int(bounds[b] + counts[b])
        out[where[b]] = Draft(tokens[lo:hi].astype(np.int64), parents[lo:hi], weights[lo:hi], ns[b])
    return bad
