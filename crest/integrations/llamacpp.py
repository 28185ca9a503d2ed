"""crest stores as llama.cpp n-gram lookup caches: what `crest export --format llama-lookup` writes.

llama.cpp's `ngram-cache` speculative method (`llama-server --spec-type ngram-cache`, and the `llama-lookup`
example) drafts from three caches of n-gram -> next-token counts: one built from the request's own context, a
dynamic one (`--lookup-cache-dynamic FILE`, n = 1..4) and a static one (`--lookup-cache-static FILE`, read with
2-token keys only, which weights the candidates of the other two and drafts alone when they have none). Both
files have the layout of `common_ngram_cache_save` (llama.cpp `common/ngram-cache.cpp`): a flat list of records,
each the n-gram as 4 int32 token ids padded with -1 (`LLAMA_TOKEN_NULL`), an int32 number of continuations, and
that many (int32 token, int32 count) pairs, little-endian, counts > 0, no header. A crest row of n <= 4 tokens
gives one record: its key, and the root children of its tree with their weights (the continuations through
each; those the tree pruned are absent). One file serves as both caches. The ids are the store's tokenizer's,
so the store must be built with the model's own GGUF tokenizer (`check_gguf` compares fingerprints).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from crest_client.batch_codec import decode_trees
from crest_client.errors import FingerprintMismatch, StoreNotFound
from crest_client.info import StoreInfo, read_info

from crest._outputs import output_file, replacing
from crest.db import ngram_table, session
from crest.errors import ConfigError

NGRAM_MAX = 4  # LLAMA_NGRAM_MAX: every record's n-gram is this many int32 ids
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL pads n-grams shorter than NGRAM_MAX
INT32_MAX = 2**31 - 1
TIER_CHOICES = ("static", "live", "all")
_BATCH = 4096  # rows decoded per decode_trees call

NgramCounts = dict[tuple[int, ...], dict[int, int]]


@dataclass
class LookupExport:
    """What one export wrote: the file, the tiers read, records per n and continuation pairs."""

    path: str
    store: str
    tiers: list[str]
    records: int
    continuations: int
    bytes: int
    by_n: dict[int, int] = field(default_factory=dict)
    gguf_checked: bool = False


def store_versions(dsn: str, store: str, *, tiers: str = "static") -> list[StoreInfo]:
    """Return the published versions of the store's `tiers` (static, live, or all: static and live if any)."""
    if tiers not in TIER_CHOICES:
        raise ConfigError(f"--tier must be one of {', '.join(TIER_CHOICES)}, not {tiers!r}")

    def connection() -> Any:
        return psycopg.connect(dsn, autocommit=True)

    versions: list[StoreInfo] = []
    for tier in ("static", "live") if tiers == "all" else (tiers,):
        try:
            versions.append(read_info(connection, store, tier=tier))
        except StoreNotFound:
            if tier == "static" or tiers == "live":
                raise
    return versions


def store_counts(dsn: str, versions: list[StoreInfo]) -> NgramCounts:
    """Return {n-gram: {next token: count}} of the versions' rows of n <= 4, counts summed over versions."""
    counts: NgramCounts = {}
    for info in versions:
        for key, tokens, weights in _root_children(dsn, info):
            part = counts.setdefault(key, {})
            for token, weight in zip(tokens, weights, strict=True):
                part[token] = min(INT32_MAX, part.get(token, 0) + weight)
    return counts


def _root_children(dsn: str, info: StoreInfo) -> Iterator[tuple[tuple[int, ...], list[int], list[int]]]:
    """Yield (key tokens, root children's tokens, their weights) for every row of n <= 4 of one version."""
    query = psycopg.sql.SQL("SELECT n, key, tree FROM {} WHERE n <= %s ORDER BY n, key").format(ngram_table(info.id))
    key_dtype = np.dtype(f">u{info.token_width}")  # keys are big-endian ids of the version's width
    with session(dsn) as conn, conn.cursor(name="crest_llama_export") as cur:
        cur.itersize = _BATCH
        cur.execute(query, (NGRAM_MAX,))
        while rows := cur.fetchmany(_BATCH):
            drafts = decode_trees([bytes(r[2]) for r in rows], [int(r[0]) for r in rows], table=info.table)
            for (_, key, _), draft in zip(rows, drafts, strict=True):
                top = draft.parents < 0  # [T] the root's children: the next token after the key
                if top.any():
                    ids = tuple(np.frombuffer(bytes(key), dtype=key_dtype).astype(np.int64).tolist())
                    yield ids, draft.tokens[top].tolist(), draft.weights[top].tolist()


def encode_cache(counts: NgramCounts) -> bytes:
    """Return `counts` in llama.cpp's ngram-cache file layout, records sorted by n then ids (reproducible)."""
    out = array("i")  # C ints: checked to be int32, written little-endian below
    for key in sorted(counts, key=lambda k: (len(k), k)):
        part = {t: c for t, c in counts[key].items() if c > 0}
        if not part or not 1 <= len(key) <= NGRAM_MAX:
            continue  # llama.cpp's loader asserts a record has continuations; longer keys are never looked up
        out.extend(key)
        out.extend([TOKEN_NULL] * (NGRAM_MAX - len(key)))
        out.append(len(part))
        for token in sorted(part, key=lambda t: (-part[t], t)):
            out.extend((token, min(INT32_MAX, part[token])))
    if out.itemsize != 4:
        raise ConfigError("this platform's C int is not 32 bits; llama.cpp's cache format needs int32")
    if sys.byteorder == "big":
        out.byteswap()  # llama.cpp writes raw memory: little-endian on the x86 and ARM machines it runs on
    return out.tobytes()


def check_gguf(gguf: str | Path, info: StoreInfo) -> None:
    """Raise FingerprintMismatch unless the GGUF's tokenizer is the one the store was built with."""
    from crest.decoding.tokenizer import load_tokenizer

    path = Path(gguf).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ConfigError(f"--gguf {str(gguf)!r}: no such .gguf file")
    tokenizer = load_tokenizer(str(path))
    if tokenizer.fingerprint != info.fingerprint:
        raise FingerprintMismatch(
            f"store {info.name!r} was built with another tokenizer than {path.name}'s: llama.cpp would read its"
            f" token ids as other tokens (build the store with --tokenizer {path})"
        )


def export_llama_lookup(
    dsn: str, store: str, out: str | Path, *, tiers: str = "static", gguf: str | Path | None = None
) -> LookupExport:
    """Write the store's n-grams (n <= 4) and their next-token counts as a llama.cpp lookup cache file."""
    path = output_file(out, option="OUT")  # written through a link, never over a device
    if not path.parent.is_dir():
        raise ConfigError(f"{str(path.parent)!r}: no such directory")
    with replacing(path) as sink:  # a reader never sees half a file
        versions = store_versions(dsn, store, tiers=tiers)
        if gguf is not None:
            check_gguf(gguf, versions[0])  # before reading every row: a wrong tokenizer is found at once
        counts = store_counts(dsn, versions)
        data = encode_cache(counts)
        sink.write(data)
    by_n: dict[int, int] = {}
    for key in counts:
        by_n[len(key)] = by_n.get(len(key), 0) + 1
    return LookupExport(
        path=str(path),
        store=store,
        tiers=[v.tier for v in versions],
        records=len(counts),
        continuations=sum(len(p) for p in counts.values()),
        bytes=len(data),
        by_n=dict(sorted(by_n.items())),
        gguf_checked=gguf is not None,
    )
