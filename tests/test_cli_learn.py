"""`crest learn`, `crest refresh`, `crest forget` and the learned figures of `crest stores`, through `main()`.

Transcripts of every kind land in the learned log with the store's tokenizer (a prompt's last `PROMPT_TAIL` tokens,
as a server keeps them); a bad file is one error line
with exit 2 and appends nothing; refresh prints the live version or "nothing new"; forget asks first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import psycopg
import pytest

from crest.decoding.tokenizer import load_tokenizer
from crest.errors import EXIT_FAILURE, EXIT_USAGE
from crest.learning.requests import PROMPT_TAIL
from tests.fix_cli import Terminal, one_error_line, run
from tests.fix_corpus import write_jsonl
from tests.fix_learning import OPTIONS, STATIC_TEXT

pytest_plugins = ["tests.fix_corpus"]


@pytest.fixture()
def words(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Publish static store `words` and point CREST_DATABASE_URL at its database."""
    from crest.ingest.pipeline import ingest

    corpus = write_jsonl(tmp_path / "static.jsonl", [{"text": t} for t in STATIC_TEXT * 2])
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    return db_dsn


def learned(dsn: str) -> list[tuple[list[int], int, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tokens, prompt_tokens, source FROM crest_learned ORDER BY id").fetchall()
    return [(list(memoryview(bytes(t)).cast("I")), int(p), str(s)) for t, p, s in rows]


def test_learn_reads_every_kind_of_transcript_with_the_store_tokenizer(
    words: str,
    word_tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tok = load_tokenizer(word_tokenizer_dir)
    records = [
        {"tokens": [2, 3, 4], "prompt_tokens": 1},
        {"text": "the cat sat"},
        {"prompt": "a dog", "completion": "sat on a mat"},
        {"prompt": "a", "response": "cat"},
    ]
    jsonl = write_jsonl(tmp_path / "log.jsonl", records)
    text = tmp_path / "answer.txt"
    text.write_text("the dog sat on the mat\n")
    code, out, err = run(monkeypatch, capsys, "learn", str(jsonl), str(text), "--store", "words")
    assert code == 0, err
    assert out.strip() == "learned 5 rows (20 tokens) from 2 files for store 'words'"
    assert learned(words) == [
        ([2, 3, 4], 1, "file"),
        (tok.encode("the cat sat"), 0, "file"),
        (tok.encode("a dog") + tok.encode("sat on a mat"), 2, "file"),
        (tok.encode("a cat"), 1, "file"),
        (tok.encode("the dog sat on the mat"), 0, "file"),
    ]


def test_learn_keeps_a_records_prompt_as_a_server_keeps_a_requests(
    words: str,
    word_tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tok = load_tokenizer(word_tokenizer_dir)
    prompt = [2 + i % 7 for i in range(PROMPT_TAIL + 30)]
    words_prompt = " ".join(["the cat sat on the mat"] * 20)  # 120 words
    records = [
        {"tokens": [*prompt, 5, 6], "prompt_tokens": len(prompt)},
        {"prompt": words_prompt, "completion": "a dog"},
    ]
    code, _, err = run(monkeypatch, capsys, "learn", str(write_jsonl(tmp_path / "long.jsonl", records)),
                       "--store", "words")  # fmt: skip
    assert code == 0, err
    assert (
        learned(words)
        == [  # the prompt's last PROMPT_TAIL tokens, as `crest serve` and vLLM write them
            ([*prompt[-PROMPT_TAIL:], 5, 6], PROMPT_TAIL, "file"),
            (tok.encode(words_prompt)[-PROMPT_TAIL:] + tok.encode("a dog"), PROMPT_TAIL, "file"),
        ]
    )


BAD_FILES = [
    ("not-json", '{"text": "the cat"}\n{oops\n', r"log\.jsonl:2: not JSON"),
    ("unknown-record", '{"text": "the"}\n{"answer": "x"}\n', r"log\.jsonl:2: expected \"tokens\", \"text\""),
    ("id-outside-vocab", '{"tokens": [2, 900]}\n', r"log\.jsonl:1: token id 900 is outside the store's vocabulary"),
    ("bad-prompt-tokens", '{"tokens": [2, 3], "prompt_tokens": 3}\n', r"\"prompt_tokens\" must be an integer"),
    ("missing-file", None, r"missing\.jsonl: no such file"),
]


@pytest.mark.parametrize(("content", "pattern"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_learn_bad_file_is_one_error_line_and_appends_nothing(
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    pattern: str,
) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "the cat sat"}])
    bad = tmp_path / ("log.jsonl" if content is not None else "missing.jsonl")
    if content is not None:
        bad.write_text(content)
    code, out, err = run(monkeypatch, capsys, "learn", str(good), str(bad), "--store", "words")
    assert code == EXIT_USAGE and out == ""
    assert re.search(pattern, one_error_line(err)), err
    assert learned(words) == []


def test_learn_for_a_store_that_does_not_exist_fails(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"tokens": [1]}])
    code, _, err = run(monkeypatch, capsys, "learn", str(path), "--store", "nope", "--dsn", db_dsn)
    assert code == EXIT_FAILURE and "no published store named 'nope'" in one_error_line(err)


@pytest.mark.parametrize(("flags", "mode"), [([], "incremental"), (["--full"], "full")], ids=["incremental", "full"])
def test_a_second_refresh_copies_unchanged_rows_unless_full(
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    mode: str,
) -> None:
    texts = ["the dog sat on the cat", "a dog sat on the cat", "the cat sat on a dog"]
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts * 3])
    assert run(monkeypatch, capsys, "learn", str(first), "--store", "words")[0] == 0
    assert run(monkeypatch, capsys, "refresh", "--store", "words")[0] == 0
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "a cat and a dog"}])
    assert run(monkeypatch, capsys, "learn", str(second), "--store", "words")[0] == 0
    code, out, err = run(monkeypatch, capsys, "refresh", "--store", "words", *flags)
    found = re.search(rf"; {mode} build, ([\d,]+) rows copied, ([\d,]+) built", out)
    assert code == 0 and found, (out, err)
    copied = int(found.group(1).replace(",", ""))
    assert (copied > 0) == (mode == "incremental"), out


def test_refresh_then_nothing_new_then_forget(
    words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "the dog sat on the cat"}, {"text": "a dog sat on the cat"}])
    assert run(monkeypatch, capsys, "learn", str(path), "--store", "words")[0] == 0
    code, out, err = run(monkeypatch, capsys, "refresh", "--store", "words", "--min-new-tokens", "13")
    assert (code, out.strip()) == (0, "store 'words': nothing new"), err
    code, out, err = run(monkeypatch, capsys, "refresh", "--store", "words", "--window", "100")
    found = re.fullmatch(
        r"store 'words': live version (\d+) published from learned rows 1\.\.2 \(2 rows, 12 tokens, 2 new\): "
        r"(\d+) n-grams, [\d.]+ MB; full build, 0 rows copied, \d+ built in [\d.]+ s\n",
        out,
    )
    assert code == 0 and found and int(found.group(2)) > 0, (out, err)
    live = int(found.group(1))
    code, out, _ = run(monkeypatch, capsys, "refresh", "--store", "words", "--json")
    assert (code, json.loads(out)) == (0, None)

    code, out, _ = run(monkeypatch, capsys, "stores")
    assert code == 0 and re.search(rf"words\s+{live}\s+live|version\s+{live}\s+tier\s+live", out), out
    code, out, _ = run(monkeypatch, capsys, "stores", "--json")
    assert {(r["tier"], r["learned_rows"]) for r in json.loads(out)} == {("static", 2), ("live", 2)}

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, _, err = run(monkeypatch, capsys, "forget", "--store", "words")
    assert code == EXIT_FAILURE and "aborted" in err
    assert len(learned(words)) == 2
    code, out, _ = run(monkeypatch, capsys, "forget", "--store", "words", "--before", "2000-01-01T00:00:00Z", "--yes")
    assert (code, out.strip()) == (0, f"store 'words': forgot 0 learned rows; live versions dropped: {live}")
    code, out, _ = run(monkeypatch, capsys, "forget", "--store", "words", "--yes")
    assert (code, out.strip()) == (0, "store 'words': forgot 2 learned rows; live versions dropped: none")
    assert learned(words) == []


BAD_OPTIONS = [
    ("before-not-a-time", ["forget", "--store", "words", "--before", "yesterday", "--yes"], r"not an ISO 8601 time"),
    ("window-zero", ["refresh", "--store", "words", "--window", "0"], r"--window must be at least 1"),
    ("bad-store-name", ["refresh", "--store", "no-such name"], r"store name"),
]


@pytest.mark.parametrize(("args", "pattern"), [b[1:] for b in BAD_OPTIONS], ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options_are_one_error_line_with_exit_2(
    words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], pattern: str
) -> None:
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == EXIT_USAGE and out == "" and re.search(pattern, one_error_line(err)), err
