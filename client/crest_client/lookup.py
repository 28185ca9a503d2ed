"""The lookup statements and the keys they probe: one rule for a single context and for a batch.

`candidate_keys` lists, for each context of a batch, the keys of its suffixes (longest first) that the version's
key filter may hold: one pass per tail hashes every suffix and tests the filter (a stored key always passes), so
a context none of whose suffixes passes costs no probe. A single lookup is a batch of one. `lookup_sql` returns
the statement for a batch: for one context in one version, a UNION ALL of single-key probes longest first under
LIMIT 1 (`probe_sql`; the server stops at the first hit, each probe an O(1) hash-index scan); otherwise
`batch_sql`, whose two array parameters list the (context index, key) pairs of every version looked up, joined
to the partition by a nested loop of hash-index probes, DISTINCT ON keeping each context's longest hit. With a
live tier the statement holds a second part over the live version's partition, so one round trip returns both
candidates. Every statement's rows are (context index, part, n, count, tree).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg import pq

from crest_client.batch_codec import decode_trees
from crest_client.codec import decode_tree
from crest_client.draft import Draft
from crest_client.errors import CodecError
from crest_client.keyfilter import MUL, SEED


def probe_sql(store_id: int, probes: int, *, every: bool = False) -> str:
    """Return the one-round-trip lookup of one context's `probes` keys in a store version, longest first.

    Rows (context index 0, part 0, n, count, tree): the first hit only, the server stopping there; with `every`,
    every stored key's row, for a rule that weighs them.
    """
    probe = f"(SELECT 0, 0, n, count, tree FROM crest_ngrams_s{int(store_id)} WHERE key = %s)"
    return " UNION ALL ".join([probe] * probes) + ("" if every else " LIMIT 1")


def batch_sql(version_ids: Sequence[int], *, every: bool = False) -> str:
    """Return the lookup of many contexts in the given versions (static, then live).

    Rows (i, part, n, count, tree): each context's longest stored key per version, or with `every` all of them.
    """
    parts = []
    for part, sid in enumerate(version_ids):
        pick = "" if every else "DISTINCT ON (q.i) "
        order = "" if every else " ORDER BY q.i, t.n DESC"
        parts.append(
            f"(SELECT {pick}q.i, {part} AS part, t.n, t.count, t.tree"
            f" FROM unnest(%s::int4[], %s::bytea[]) AS q(i, key) JOIN crest_ngrams_s{int(sid)} AS t ON t.key = q.key"
            f"{order})"
        )
    return " UNION ALL ".join(parts)


def lookup_sql(version_ids: Sequence[int], probes: int | None, *, every: bool = False) -> tuple[str, str]:
    """Return (prepared statement name, SQL) looking up one context's `probes` keys, or a batch when None."""
    how = "every" if every else "first"
    if probes is not None and len(version_ids) == 1:
        return f"crest_{how}_s{int(version_ids[0])}_{probes}", probe_sql(version_ids[0], probes, every=every)
    return f"crest_batch_{how}_s{'_'.join(map(str, version_ids))}", batch_sql(version_ids, every=every)


def candidate_keys(tails: Sequence[Sequence[int]], info: Any) -> tuple[list[int], list[bytes]]:
    """Return (context index, key) pairs of every suffix of each tail that the version may hold, longest first.

    Only suffixes after a tail's last token outside the vocabulary (a padding id, a model's extra rows) count;
    `info` is a `StoreInfo` (max_n, token_width, vocab_size, key_filter).
    """
    max_n, width, vocab = info.max_n, info.token_width, info.vocab_size
    found = info.key_filter
    index: list[int] = []
    keys: list[bytes] = []
    for i, whole in enumerate(tails):
        tail = usable_tail(whole, max_n, vocab)
        m = len(tail)
        if not m:
            continue
        raw = tail_bytes(tail, width)
        h, starts = SEED, []
        for k in range(m - 1, -1, -1):  # suffixes shortest first: the hash of tail[k:] extends that of tail[k+1:]
            h = ((h ^ tail[k]) * MUL) & _M64
            h ^= h >> 31
            if found is None or h in found:
                starts.append(k)
        for k in reversed(starts):  # longest first
            index.append(i)
            keys.append(raw[k * width :])
    return index, keys


def tail_bytes(tail: Sequence[int], width: int) -> bytes:
    """Return a tail's ids as a store keys them: big-endian, `width` bytes each (a suffix's key is a suffix of it)."""
    code = _STRUCT_CODES.get(width)
    return struct.pack(f">{len(tail)}{code}", *tail) if code else b"".join([t.to_bytes(width, "big") for t in tail])


def suffix_keys(tail: Sequence[int], width: int, max_n: int) -> list[bytes | None]:
    """Return the keys of the tail's suffixes of n = max_n .. 1 tokens (None where the tail is shorter than n)."""
    raw = tail_bytes(tail, width)
    return [raw[len(raw) - k * width :] if k <= len(tail) else None for k in range(max_n, 0, -1)]


def usable_tail(context: Sequence[int] | np.ndarray, max_n: int, vocab: int) -> list[int]:
    """Return the context's last `max_n` tokens after its last token outside [0, vocab): the suffixes a store holds."""
    tail = [int(t) for t in context[-max_n:]] if max_n > 0 else []
    bad = [k for k, t in enumerate(tail) if t < 0 or t >= vocab]
    return tail[bad[-1] + 1 :] if bad else tail


batch_keys = candidate_keys  # the name earlier releases exported

_STRUCT_CODES = {1: "B", 2: "H", 4: "I"}  # big-endian token widths struct packs in one call

_M64 = (1 << 64) - 1


def decode_rows(rows: Sequence[tuple[int, bytes]], info: Any) -> tuple[list[Draft | None], list[str]]:
    """Decode many (n, tree) rows of a version at once; return the drafts (None where corrupt) and the errors."""
    if not rows:
        return [], []
    if len(rows) >= _BATCH_DECODE:  # below, the one-blob decoder is faster
        try:
            batch: list[Draft | None] = list(decode_trees([t for _, t in rows], [n for n, _ in rows], table=info.table))
            if all(_in_vocabulary(tree, draft, info) for (_, tree), draft in zip(rows, batch, strict=True)):
                return batch, []
        except CodecError:
            pass
    drafts: list[Draft | None] = []  # one by one: a corrupt tree is a miss, the others still draft
    errors: list[str] = []
    for n, tree in rows:
        try:
            draft = decode_tree(tree, n=int(n), table=info.table)
            if not _in_vocabulary(tree, draft, info):
                raise CodecError(f"a token id is outside the store's vocabulary of {info.vocab_size}")
            drafts.append(draft)
        except CodecError as exc:
            drafts.append(None)
            errors.append(str(exc))
    return drafts, errors


_BATCH_DECODE = 8  # rows from which one batch decode (`decode_trees`) beats decoding them one by one


def _in_vocabulary(tree: bytes, draft: Draft | None, info: Any) -> bool:
    """Return whether a decoded tree's ids are the store's (ranked blobs' ids come from the checked table)."""
    ranked = tree[:1] == b"\x02" and len(tree) > 1 and tree[1] & 1
    return draft is None or not len(draft) or bool(ranked) or int(draft.tokens.max()) < info.vocab_size


INT4_ARRAY, BYTEA_ARRAY = 1007, 1001  # type oids of the batch statement's parameters
_INT4, _BYTEA = 23, 17
_ARRAY_HEAD = struct.Struct("!iiiii")  # ndim, has nulls, element oid, length, lower bound
_LENGTH = struct.Struct("!i")


def int4_array(values: Sequence[int]) -> bytes:
    """Return PostgreSQL's binary form of an int4[] holding `values`."""
    if not values:
        return struct.pack("!iii", 0, 0, _INT4)
    body = np.empty((len(values), 2), dtype=">i4")  # [K, 2] each element's length (4) and value
    body[:, 0], body[:, 1] = 4, values
    return _ARRAY_HEAD.pack(1, 0, _INT4, len(values), 1) + body.tobytes()


def bytea_array(values: Sequence[bytes]) -> bytes:
    """Return PostgreSQL's binary form of a bytea[] holding `values`."""
    if not values:
        return struct.pack("!iii", 0, 0, _BYTEA)
    pack = _LENGTH.pack
    return _ARRAY_HEAD.pack(1, 0, _BYTEA, len(values), 1) + b"".join([pack(len(v)) + v for v in values])


def numbered(query: str) -> str:
    """Return `query` with psycopg's %s placeholders numbered for libpq ($1, $2, ...)."""
    parts = query.split("%s")
    return "".join(part + (f"${i}" if i < len(parts) else "") for i, part in enumerate(parts, 1))


def check_result(res: Any) -> Any:
    """Return a libpq result, or raise the psycopg error its SQLSTATE names."""
    if res.status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        return res
    state = res.error_field(pq.DiagnosticField.SQLSTATE)
    message = (res.error_message or b"").decode(errors="replace").strip() or "lookup failed"
    if state is None:
        raise psycopg.OperationalError(message)
    raise psycopg.errors.lookup(state.decode())(message)
