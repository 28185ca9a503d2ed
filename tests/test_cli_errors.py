"""The bad-input checklist, through the real CLI entry point: one clear line, non-zero exit, nothing half-written.

Each case runs `crest.cli.main()` in this process (argv patched; the same error mapping as the `crest`
script) on a fresh database, and checks the exit code, that stderr is one `Error: ...` line naming the
problem with no traceback, and that no store row (other than a table-less `failed` record) and no store table
is left behind. A huge single document is no error: it is streamed, and its ingest is checked to succeed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from crest.cli.app import main
from crest.decoding.tokenizer import load_tokenizer
from tests.fix_corpus import CONVERSATIONS, record_starts, write_sharegpt

pytest_plugins = ["tests.fix_corpus"]

Make = Callable[[Path], Path]


def _text(name: str, content: str) -> Make:
    def make(root: Path) -> Path:
        (root / name).write_text(content, encoding="utf-8")
        return root / name

    return make


def _bytes(name: str, content: bytes) -> Make:
    def make(root: Path) -> Path:
        (root / name).write_bytes(content)
        return root / name

    return make


def _empty_dir(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def _truncated(root: Path) -> Path:
    data = json.dumps(CONVERSATIONS[:1], indent=2).encode()
    return write_sharegpt(root / "cut.json", CONVERSATIONS[:1], cut=record_starts(data)[0] + 30)


def _fifo(root: Path) -> Path:
    os.mkfifo(root / "pipe.txt")  # opening it would block: a file that cannot be read as a document
    return root / "pipe.txt"


def _broken_link(root: Path) -> Path:
    (root / "gone.txt").symlink_to(root / "nowhere.txt")
    return root / "gone.txt"


def _bad_tokenizer_dir(root: Path) -> Path:
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text('{"model": 42}')
    return root / "tok"


HELLO = _text("a.txt", "the cat sat on the mat\n")

# (id, corpus maker, extra arguments, pattern the one stderr line must match)
CASES: list[tuple[str, Make, list[str], str]] = [
    ("empty-corpus", _text("e.jsonl", ""), [], r"no documents|no tokens"),
    ("empty-directory", _empty_dir, [], r"holds no file"),
    ("empty-documents", _text("b.jsonl", '{"text": "  "}\n{"text": ""}\n'), [], r"no documents|no tokens"),
    ("truncated-json", _truncated, [], r"no (documents|tokens).*(cut|truncated)"),
    ("malformed-json", _text("m.json", '[{"conversations": [}]'), [], r"m\.json.*not valid JSON"),
    ("malformed-jsonl", _text("m.jsonl", '{"text": "a"}\n{oops}\n{"text": "b"}\n'), [], r"line 2 is not valid JSON"),
    ("invalid-utf8-jsonl", _bytes("u.jsonl", b'{"text": "\xff\xfe"}\n'), [], r"not valid UTF-8"),
    ("invalid-utf8-file", _bytes("u.txt", b"\xff\xfe text"), [], r"no (documents|tokens).*not UTF-8"),
    ("unreadable-fifo", _fifo, [], r"not a regular file"),
    ("unreadable-broken-symlink", _broken_link, [], r"does not exist"),
    ("missing-file", lambda root: root / "missing.jsonl", [], r"does not exist"),
    ("empty-glob", lambda root: root / "*.nothing", [], r"matches no file"),
    ("unknown-format", HELLO, ["--format", "xml"], r"unknown format 'xml'"),
    ("tokenizer-missing", HELLO, ["--tokenizer", "/nonexistent/tok"], r"cannot load tokenizer"),
    ("tokenizer-malformed", HELLO, ["--tokenizer", "{bad_tokenizer}"], r"cannot load tokenizer"),
    ("tokenizer-empty-dir", HELLO, ["--tokenizer", "{empty_dir}"], r"cannot load tokenizer .*holds no tokenizer"),
    ("store-name-not-identifier", HELLO, ["--store", "x; DROP TABLE crest_stores"], r"not a plain identifier"),
    ("store-name-quote", HELLO, ["--store", 'a"b'], r"not a plain identifier"),
    ("top-t-zero", HELLO, ["--top-t", "0"], r"--top-t must be a positive"),
    ("top-t-negative", HELLO, ["--top-t", "-3"], r"--top-t must be a positive"),
    ("budget-negative", HELLO, ["--budget", "-5MB"], r"size '-5MB'"),
    ("budget-zero", HELLO, ["--budget", "0"], r"size '0' must be positive"),
    ("tree-size-negative", HELLO, ["--tree-size", "-1"], r"--tree-size must be between"),
    ("max-n-negative", HELLO, ["--max-n", "-2"], r"--max-n must be between"),
    ("continuation-length-negative", HELLO, ["--continuation-length", "-4"], r"--continuation-length must be"),
    ("max-matches-negative", HELLO, ["--max-matches", "-1"], r"--max-matches must be between"),
    ("budget-too-small", _text("a.txt", "the cat sat on the mat\n" * 50), ["--budget", "10"], r"budget is too small"),
    ("top-t-and-budget", HELLO, ["--top-t", "5", "--budget", "1MB"], r"either --top-t or --budget"),
    ("chunk-tokens-zero", HELLO, ["--chunk-tokens", "0"], r"--chunk-tokens must be positive"),
    ("dense-option-without-model", HELLO, ["--dense-dims", "8"], r"--dense-dims needs --dense-model"),
    ("dense-options-without-model", HELLO, ["--dense-batch", "8", "--dense-index", "hnsw"], r"need --dense-model"),
]


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dsn: str, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("CREST_DATABASE_URL", dsn)
    monkeypatch.setattr(sys, "argv", ["crest", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    return int(done.value.code or 0), capsys.readouterr().err


def _nothing_left(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, state FROM crest_stores WHERE state <> 'failed'").fetchall()
        tables = conn.execute(
            "SELECT relname FROM pg_class WHERE relname ~ '^crest_[a-z_]+_s[0-9]+$' AND relkind = 'r'"
        ).fetchall()
    assert rows == [] and tables == []


def _assert_one_clear_line(code: int, err: str, pattern: str) -> None:
    assert code != 0
    assert "Traceback" not in err and "unexpected" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert re.search(pattern, lines[0]), err


@pytest.mark.parametrize(("make", "extra", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_ingest_input(
    db_dsn: str,
    tmp_path: Path,
    word_tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Make,
    extra: list[str],
    pattern: str,
) -> None:
    target = make(tmp_path)
    if "{bad_tokenizer}" in extra:
        extra = [str(_bad_tokenizer_dir(tmp_path)) if e == "{bad_tokenizer}" else e for e in extra]
    if "{empty_dir}" in extra:
        extra = [str(_empty_dir(tmp_path)) if e == "{empty_dir}" else e for e in extra]
    args = ["ingest", str(target), "--store", "s", "--tokenizer", str(word_tokenizer_dir), "--quiet"]
    if "--top-t" not in extra and "--budget" not in extra:
        args += ["--top-t", "100"]
    code, err = _run(monkeypatch, capsys, db_dsn, *args, *extra)
    _assert_one_clear_line(code, err, pattern)
    _nothing_left(db_dsn)


def test_store_of_another_tokenizer(
    db_dsn: str,
    tmp_path: Path,
    word_tokenizer_dir: Path,
    smollm2_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    corpus = HELLO(tmp_path)
    args = ["ingest", str(corpus), "--store", "s", "--tokenizer", str(word_tokenizer_dir), "--quiet", "--top-t", "9"]
    assert _run(monkeypatch, capsys, db_dsn, *args)[0] == 0
    code, err = _run(monkeypatch, capsys, db_dsn, "lookup", "--store", "s", "--tokenizer", str(smollm2_gguf), "cat")
    _assert_one_clear_line(code, err, r"store 's' was built with another tokenizer")


def test_huge_single_document_is_streamed(
    db_dsn: str,
    tmp_path: Path,
    word_tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    corpus = tmp_path / "huge.txt"
    line = "the cat sat on the mat a dog sat on the cat\n"
    corpus.write_text(line * (2_000_000 // len(line)))  # 2 MB: eight 256 KB pieces of one document
    args = ["ingest", str(corpus), "--store", "s", "--tokenizer", str(word_tokenizer_dir), "--quiet", "--top-t", "50"]
    code, err = _run(monkeypatch, capsys, db_dsn, *args)
    assert code == 0, err
    with psycopg.connect(db_dsn) as conn:
        figures = conn.execute("SELECT figures FROM crest_stores WHERE state = 'published'").fetchone()
    assert figures is not None
    per_line = len(load_tokenizer(word_tokenizer_dir).encode(line))
    assert figures[0]["documents"] == 1 and figures[0]["tokens"] == per_line * (2_000_000 // len(line))


# (id, arguments after a store `s` of the word tokenizer exists, pattern of the one stderr line): other commands
COMMAND_CASES: list[tuple[str, list[str], str]] = [
    ("lookup-text-not-utf8", ["lookup", "--store", "s", "cat \udcff\udcfe"], r"TEXT is not valid UTF-8"),
    ("lookup-max-nodes-zero", ["lookup", "--store", "s", "--max-nodes", "0", "cat"], r"--max-nodes must be at least"),
    # generate and serve get a --model that names nothing: each check is made before the model would load
    ("generate-prompt-not-utf8", ["generate", "\udcffcat", "--drafter", "prompt"], r"PROMPT is not valid UTF-8"),
    ("generate-temperature", ["generate", "cat", "--temperature", "-1"], r"temperature must be >= 0"),
    ("generate-top-p", ["generate", "cat", "--top-p", "0"], r"top_p must be in"),
    ("generate-draft-tokens", ["generate", "cat", "--max-draft-tokens", "-1"], r"max_draft_tokens must be >= 0"),
    ("generate-no-prompts", ["generate", "--prompts", "{empty}", "--drafter", "prompt"], r"no prompts in"),
    ("learn-nothing", ["learn", "--store", "s", "{empty}"], r"nothing to learn"),
    ("learn-no-tokens", ["learn", "--store", "s", "{no_tokens}"], r"nothing to learn"),
    ("forget-before-year-1", ["forget", "--store", "s", "--yes", "--before", "0001-01-01"], r"out of range"),
    ("forget-without-terminal", ["forget", "--store", "s"], r"asks for confirmation and stdin is not a terminal"),
    ("drop-name", ["drop", "a;b", "--yes"], r"not a plain identifier"),
    ("serve-port-in-use", ["serve", "--port", "{busy}"], r"cannot listen on 127\.0\.0\.1:\d+"),
    ("serve-refresh-nan", ["serve", "--refresh-interval", "nan"], r"--refresh-interval >= 0"),
    ("weight-superscript", ["ingest", "{corpus}", "--store", "w", "--weight", "{corpus}=\u00b2"], r"K must be a"),
    ("weight-arabic-indic", ["ingest", "{corpus}", "--store", "w", "--weight", "{corpus}=\u0661"], r"K must be a"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "pattern"), [c[1:] for c in COMMAND_CASES], ids=[c[0] for c in COMMAND_CASES])
def test_bad_command_input(
    db_dsn: str,
    tmp_path: Path,
    word_tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    pattern: str,
) -> None:
    corpus = HELLO(tmp_path)
    made = ["ingest", str(corpus), "--store", "s", "--tokenizer", str(word_tokenizer_dir), "--quiet", "--top-t", "9"]
    assert _run(monkeypatch, capsys, db_dsn, *made)[0] == 0
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "none.jsonl").write_text('{"tokens": []}\n')
    paths = {"{corpus}": str(corpus), "{empty}": str(tmp_path / "empty.jsonl")}
    paths["{no_tokens}"] = str(tmp_path / "none.jsonl")
    busy = socket.socket()  # listening, as another server on the port would be
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    paths["{busy}"] = str(busy.getsockname()[1])
    args = [paths.get(a, a).replace("{corpus}", str(corpus)) for a in args]
    if args[0] == "ingest":
        args += ["--tokenizer", str(word_tokenizer_dir), "--quiet", "--top-t", "9"]
    if args[0] in ("generate", "serve"):
        args += ["--model", str(tmp_path / "no-model"), "--drafter", "prompt"]
    with psycopg.connect(db_dsn) as conn:
        before = conn.execute("SELECT count(*) FROM crest_learned").fetchone()
    with busy:
        code, err = _run(monkeypatch, capsys, db_dsn, *args)
    assert code == 2, err
    _assert_one_clear_line(code, err, pattern)
    with psycopg.connect(db_dsn) as conn:  # nothing learned, nothing dropped or added
        assert conn.execute("SELECT count(*) FROM crest_learned").fetchone() == before
        assert conn.execute("SELECT name, state FROM crest_stores").fetchall() == [("s", "published")]
