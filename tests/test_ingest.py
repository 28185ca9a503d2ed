"""End to end on real text with the real SmolLM2 tokenizer: ingest -> SDK lookup -> CLI lookup -> SQL."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psycopg
import pytest
from crest_client import FingerprintMismatch, Store

from crest.config import IngestOptions
from crest.decoding.tokenizer import load_tokenizer
from crest.errors import EXIT_USAGE, ConfigError, DatabaseError
from crest.ingest.pipeline import ingest
from tests.fix_cli import run_cli

SQL = Path(__file__).resolve().parent.parent / "sql"
TEXT = [
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "def mul(a, b):\n    return a * b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]


@pytest.fixture(scope="module")
def gguf(smollm2_gguf: Path) -> str:
    return str(smollm2_gguf)


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT * 3))
    return path


def test_ingest_lookup_sql(db_dsn: str, corpus: Path, gguf: str) -> None:
    summary = ingest([str(corpus)], store="code", tokenizer=gguf, dsn=db_dsn, options=IngestOptions(top_t=1000))
    tok = load_tokenizer(gguf)
    assert summary.documents == len(TEXT) * 3
    assert summary.tokens == 3 * sum(len(tok.encode(t)) for t in TEXT)
    assert summary.table_bytes > 0 and summary.index_bytes > 0
    with Store.connect(db_dsn, "code", tokenizer_fingerprint=tok.fingerprint, timeout=2.0) as store:
        # blobs hold token ranks (format 2, ranked flag); the filter holds every stored key
        assert store.info.table is not None and store.info.key_filter is not None
        with psycopg.connect(db_dsn) as conn:
            heads = conn.execute(
                "SELECT DISTINCT get_byte(tree, 0), get_byte(tree, 1) & 1 FROM crest_ngrams"
            ).fetchall()
            keys = [bytes(k) for (k,) in conn.execute("SELECT key FROM crest_ngrams")]
        assert heads == [(2, 1)]
        assert all(store.candidate_keys(np.frombuffer(k, ">u2").tolist())[0] == k for k in keys)
        ids = tok.encode("def add(a, b):\n    return")
        draft = store.draft(ids)
        assert draft is not None and draft.n >= 2
        # "(a, b):\n    return" ends three functions: the tree holds each one's body, and nothing else
        bodies = {" a + b", " a - b", " a * b"}
        drafted = {tok.hf.decode(p).split("\n")[0] for p in draft.paths()}  # every node's path from the root
        assert bodies <= drafted and all(any(b.startswith(d) for b in bodies) for d in drafted), drafted
        # a continuation never crosses a document end: no tree reaches from one function into the next
        last = tok.encode("return a * b\n")
        tail = store.draft(last)
        assert tail is None or all("def" not in tok.hf.decode(p) for p in tail.paths())
    with pytest.raises(FingerprintMismatch):
        Store.connect(db_dsn, "code", tokenizer_fingerprint="0" * 64)
    shown = run_cli("lookup", "--store", "code", "def mul(a, b):", "--json", dsn=db_dsn)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["n"] >= 1
    listed = run_cli("stores", "--json", dsn=db_dsn)
    assert json.loads(listed.stdout)[0]["name"] == "code"
    with psycopg.connect(db_dsn) as conn:
        coverage = conn.execute((SQL / "coverage.sql").read_text()).fetchall()
        top = conn.execute((SQL / "top_ngrams.sql").read_text()).fetchall()
    assert {row[2] for row in coverage} == {1, 2, 3, 4}
    assert any("return" in row[4] for row in top)


def test_one_input_given_as_a_string_is_one_input(db_dsn: str, corpus: Path, gguf: str) -> None:
    summary = ingest(str(corpus), store="one", tokenizer=gguf, dsn=db_dsn, options=IngestOptions(top_t=100))
    assert summary.documents == len(TEXT) * 3  # not "input 'c' does not exist"


def test_a_database_error_is_one_line(corpus: Path, gguf: str) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dsn = f"postgresql://crest@127.0.0.1:{s.getsockname()[1]}/crest?connect_timeout=5"
    with pytest.raises(DatabaseError, match="cannot connect to the database") as failed:
        ingest([str(corpus)], store="none", tokenizer=gguf, dsn=dsn, options=IngestOptions(top_t=100))
    assert "\n" not in str(failed.value) and "\t" not in str(failed.value), str(failed.value)


def test_reingest_replaces_and_budget_limits_size(db_dsn: str, corpus: Path, gguf: str) -> None:
    first = ingest([str(corpus)], store="code", tokenizer=gguf, dsn=db_dsn, options=IngestOptions(top_t=1000))
    small = ingest([str(corpus)], store="code", tokenizer=gguf, dsn=db_dsn, options=IngestOptions(budget=80_000))
    assert small.store_id != first.store_id
    assert 0 < small.rows < first.rows
    # the bytes `crest stores` reports, hash index in; a heap of whole pages may pass the estimate by one page
    assert small.table_bytes + small.index_bytes <= 80_000 + 8192
    assert small.top_t is not None and small.top_t < 1000
    with psycopg.connect(db_dsn) as conn:
        states = conn.execute("SELECT state, count(*) FROM crest_stores GROUP BY state").fetchall()
    assert states == [("published", 1)]


BAD = [
    ("empty-corpus", lambda p: _write(p / "e.jsonl", ""), [], "no tokens|no document"),
    ("blank-docs", lambda p: _write(p / "b.jsonl", '{"text": "  "}\n'), [], "no tokens|no document"),
    (
        "malformed-json",
        lambda p: _write(p / "m.json", '[{"conversations": [}]'),
        [],
        "not valid JSON|cut off|no tokens",
    ),
    (
        "bad-jsonl",
        lambda p: _write(p / "m.jsonl", '{"text": "a"}\n{oops}\n{"text": "b"}\n'),
        [],
        "line 2 is not valid JSON",
    ),
    ("invalid-utf8", lambda p: _write_bytes(p / "u.jsonl", b'{"text": "\xff\xfe"}\n'), [], "not valid UTF-8"),
    ("unknown-format", lambda p: _write(p / "a.txt", "hello"), ["--format", "xml"], "unknown format"),
    ("missing-file", lambda p: p / "missing.jsonl", [], "does not exist"),
    ("empty-glob", lambda p: p / "*.nothing", [], "matches no file"),
    ("bad-store-name", lambda p: _write(p / "a.txt", "hello"), ["--store", "x;drop"], "not a plain identifier"),
    ("top-t-zero", lambda p: _write(p / "a.txt", "hello"), ["--top-t", "0"], "--top-t must be"),
    ("negative-budget", lambda p: _write(p / "a.txt", "hello"), ["--budget", "-5"], "size"),
    ("tiny-budget", lambda p: _write(p / "a.txt", "hello world " * 50), ["--budget", "10"], "budget is too small"),
    (
        "bad-tokenizer",
        lambda p: _write(p / "a.txt", "hello"),
        ["--tokenizer", "/nonexistent/tok"],
        "cannot load tokenizer",
    ),
]


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


FAST_BAD = ("malformed-json", "missing-file")  # a subprocess each (~10 s): the other cases run in the slow lane


@pytest.mark.parametrize(
    ("case", "make", "extra", "message"),
    [pytest.param(*b, marks=() if b[0] in FAST_BAD else pytest.mark.slow, id=b[0]) for b in BAD],
)
def test_bad_input_is_a_clear_error(
    db_dsn: str,
    tmp_path: Path,
    gguf: str,
    case: str,
    make: Callable[[Path], Path],
    extra: list[str],
    message: str,
) -> None:
    target = make(tmp_path)
    args = ["ingest", str(target), "--store", "s", "--tokenizer", gguf, "--quiet"]
    if "--top-t" not in extra and "--budget" not in extra:
        args += ["--top-t", "100"]
    args += extra
    home = tmp_path / "home"
    done = run_cli(*args, dsn=db_dsn, home=home)
    assert done.returncode == EXIT_USAGE, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr  # one line, crest's own message
    assert re.search(message, lines[0]) and "unexpected" not in lines[0], lines[0]
    assert done.stdout == ""
    with psycopg.connect(db_dsn) as conn:  # nothing half-written: no visible version, no table of a build
        assert conn.execute("SELECT count(*) FROM crest_stores WHERE state <> 'failed'").fetchone() == (0,)
        tables = conn.execute("SELECT relname FROM pg_class WHERE relname ~ '^crest_[a-z_]+_s[0-9]+$'").fetchall()
    assert tables == []
    assert not list((home / "work").glob("*")), "the ingest's work directory is removed"


def test_blob_formats_store_the_same_trees(db_dsn: str, corpus: Path, gguf: str) -> None:
    tok = load_tokenizer(gguf)
    for fmt in (1, 2):
        ingest(
            [str(corpus)],
            store=f"f{fmt}",
            tokenizer=gguf,
            dsn=db_dsn,
            options=IngestOptions(top_t=300, blob_format=fmt),
        )
    with psycopg.connect(db_dsn) as conn:
        versions: dict[str, list[int]] = dict(
            conn.execute(
                "SELECT s.name, array_agg(DISTINCT get_byte(g.tree, 0)) FROM crest_ngrams g"
                " JOIN crest_stores s ON s.id = g.store_id GROUP BY s.name"
            ).fetchall()
        )
    assert versions == {"f1": [1], "f2": [2]}
    with Store.connect(db_dsn, "f1", timeout=2.0) as one, Store.connect(db_dsn, "f2", timeout=2.0) as two:
        for text in TEXT:
            ids = tok.encode(text)
            for end in range(1, len(ids) + 1):
                a, b = one.draft(ids[:end]), two.draft(ids[:end])
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert (a.n, a.paths(), a.weights.tolist()) == (b.n, b.paths(), b.weights.tolist())
    with pytest.raises(ConfigError, match="blob-format"):
        IngestOptions(top_t=5, blob_format=3).validate()
