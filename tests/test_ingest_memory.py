"""Bounded memory: an ingest of a corpus many chunks long peaks no higher than one of an eighth of it.

The corpus is a base of random-word documents repeated eight times as distinct files (as the standard library
repeated would be): its token count grows, its distinct n-grams do not. Each ingest runs in a child process
(`crest ingest --chunk-tokens`), which records its own peak RSS in the store's figures. The chunked ingest of
the whole corpus must equal, row for row, an ingest that scans it in one chunk.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fix_corpus import make_word_tokenizer

WORDS = [f"w{i}" for i in range(2000)]
BASE_DOCS, DOC_WORDS, COPIES, CHUNK = 40, 5000, 8, 100_000  # 200k tokens a copy, 1.6M in all: 16 chunks
GROWTH_BOUND = 48 << 20  # bytes the 8x ingest may peak above the 1x one (its tokens file alone is 6.4 MB)


def _corpus(root: Path, copies: int) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choices(WORDS[: 200 + 45 * i], k=DOC_WORDS)) + "\n" for i in range(BASE_DOCS)]
    root.mkdir()
    for c in range(copies):
        for i, text in enumerate(docs):
            (root / f"c{c}_d{i}.txt").write_text(text)
    return root


def _ingest(dsn: str, corpus: Path, tokenizer: Path, store: str, chunk: int) -> dict[str, Any]:
    args = ["ingest", str(corpus), "--store", store, "--tokenizer", str(tokenizer), "--quiet"]
    args += ["--top-t", "2000", "--max-matches", "50", "--chunk-tokens", str(chunk)]
    env = {**os.environ, "CREST_DATABASE_URL": dsn}
    done = subprocess.run(
        [sys.executable, "-m", "crest.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT id, figures FROM crest_stores WHERE name = %s AND state = 'published'", (store,))
        sid, figures = row.fetchone() or (None, None)
        rows = conn.execute(f"SELECT n, key, count, tree FROM crest_ngrams_s{int(sid)} ORDER BY n, key").fetchall()
    return {"peak": int(figures["peak_rss_bytes"]), "tokens": int(figures["tokens"]), "rows": rows}


@pytest.mark.slow
def test_chunked_ingest_has_bounded_peak_and_equals_one_chunk(db_dsn: str, tmp_path: Path) -> None:
    tokenizer = make_word_tokenizer(tmp_path / "tok", WORDS)
    one = _ingest(db_dsn, _corpus(tmp_path / "x1", 1), tokenizer, "x1", CHUNK)
    eight = _ingest(db_dsn, _corpus(tmp_path / "x8", COPIES), tokenizer, "x8", CHUNK)
    whole = _ingest(db_dsn, tmp_path / "x8", tokenizer, "x8_whole", 1 << 24)
    assert eight["tokens"] == COPIES * one["tokens"] > 10 * CHUNK
    print(f"peak RSS MB: 1x {one['peak'] >> 20}, 8x {eight['peak'] >> 20}, 8x one chunk {whole['peak'] >> 20}")
    assert eight["peak"] - one["peak"] < GROWTH_BOUND
    assert eight["rows"] == whole["rows"] and 0.95 * 4 * 2000 < len(eight["rows"]) <= 4 * 2000
    counts = {bytes(key): count for _, key, count, _ in one["rows"]}
    assert all(count == COPIES * counts[bytes(key)] for _, key, count, _ in eight["rows"] if bytes(key) in counts)
