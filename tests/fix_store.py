"""Stores made by hand and what readers see of them: `publish` writes a version from rows you give (`ROWS`, chain
trees from `chain_tree`), `snapshot` reads every context's draft, `visible_state` lists what is published.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from crest_client import Store
from crest_client.codec import TokenTable, encode_tree, token_width
from crest_client.keyfilter import KeyFilter, hash_keys

from crest import db

VOCAB = 1000


def ngram_key(ngram: tuple[int, ...]) -> bytes:
    """Return the stored key of an n-gram of VOCAB's token width."""
    return np.asarray(ngram, dtype=f">u{token_width(VOCAB)}").tobytes()


def chain_tree(first: int, size: int) -> bytes:
    """Return an encoded chain of `size` tokens from `first`, weights falling by one."""
    tokens = np.arange(first, first + size, dtype=np.int64)
    parents = np.arange(-1, size - 1, dtype=np.int32)  # a chain
    weights = np.arange(size, 0, -1, dtype=np.int64)
    return encode_tree(tokens, parents, weights, vocab_size=VOCAB)


def publish(
    dsn: str,
    name: str,
    rows: dict[tuple[int, ...], bytes],
    *,
    fingerprint: str = "fp-a",
    data: bool = True,
    tier: str = "static",
    max_n: int = 3,
) -> int:
    """Publish a version of store `name` holding `rows` ({ngram: tree blob}); return its id."""
    build = db.begin_build(
        dsn,
        name,
        fingerprint=fingerprint,
        tokenizer="test",
        vocab_size=VOCAB,
        token_width=token_width(VOCAB),
        params={"max_n": max_n},
        tier=tier,
    )
    try:
        build.copy_vocab((i, f"<{i}>") for i in range(VOCAB))
        build.copy_ngrams((ngram_key(k), len(k), 7, tree) for k, tree in rows.items())
        if data:  # the token table and key filter an ingest writes; without them clients probe every length
            hashes = np.concatenate([hash_keys(np.array([k])) for k in rows] or [np.zeros(0, np.uint64)])
            build.write_store_data(TokenTable(np.arange(VOCAB)).to_bytes(), KeyFilter.build(hashes).to_bytes())
        build.finish_tables()
        build.publish({"kept": {"1": len(rows)}})
        return build.store_id
    finally:
        build.close()


ROWS = {(5,): chain_tree(100, 4), (4, 5): chain_tree(200, 6), (3, 4, 5): chain_tree(300, 8), (9, 9): chain_tree(400, 2)}

WORD_IDS = range(2, 9)  # the ids of fix_corpus.WORDS in the word tokenizer
CONTEXTS = [[a] for a in WORD_IDS] + [[a, b] for a in WORD_IDS for b in WORD_IDS]
OLD_TEXT = ["the cat sat on the mat", "a dog sat on a mat", "the dog sat on the cat", "the cat sat on a dog"]
Snapshot = dict[tuple[int, ...], Any]


def write_corpus(path: Path, texts: Sequence[str]) -> Path:
    """Write `texts` twice as a JSONL corpus at `path`; return the path."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*texts, *texts]))
    return path


def draft_key(draft: Any) -> Any:
    """Return a comparable value for a draft (or None)."""
    if draft is None:
        return None
    return (draft.n, draft.tokens.tolist(), draft.parents.tolist(), draft.weights.tolist())


def snapshot(dsn: str, store: str) -> Snapshot:
    """Return every context's draft from the version published now, read by a fresh handle."""
    with Store.connect(dsn, store, cache_size=0, timeout=5.0) as handle:
        return {tuple(c): draft_key(handle.draft(c)) for c in CONTEXTS}


def visible_state(dsn: str) -> dict[str, Any]:
    """Return what readers can see: published ids, attached partitions and row counts per version."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")
        ids = [int(r[0]) for r in conn.execute("SELECT id FROM crest_stores WHERE state = 'published'")]
        parts = sorted(
            str(r[0])
            for r in conn.execute(
                "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'crest_ngrams'::regclass"
            )
        )
        rows: dict[int, int] = dict(
            conn.execute("SELECT store_id, count(*) FROM crest_ngrams GROUP BY store_id").fetchall()
        )
    return {"published": ids, "partitions": parts, "rows": rows}
