"""`crest bench serve` end to end: it starts `crest serve` on a tiny random model over the real SmolLM2 tokenizer.

The model directory holds a tiny random llama and the SmolLM2 tokenizer (the store is built with the same
tokenizer, so the crest drafter is accepted), prompts come from a JSONL file, and the run covers the batch-1
baseline and two concurrency levels per drafter. Greedy output is exact, so every row must count the same
tokens and produce the same texts as `none`; the server, stopped with SIGTERM, must exit 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from crest.bench.serve import ServeFigures, check_levels
from crest.bench.serve_report import comparisons
from crest.cli.app import app
from crest.config import IngestOptions
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from tests.fix_models import tiny_model

pytest_plugins = ["tests.fix_corpus", "tests.fix_serving"]

CORPUS = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20
PROMPTS = ["def add(a, b):\n    return", "def sub(a, b):\n"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """A directory with a tiny random llama over the SmolLM2 vocabulary and the SmolLM2 tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-serve")
    tiny_model("llama", vocab=len(smollm2_tokenizer.hf), max_positions=2048).save_pretrained(str(directory))
    smollm2_tokenizer.hf.save_pretrained(str(directory))
    return directory


def test_bench_serve_end_to_end(
    db_dsn: str, tiny_dir: Path, smollm2_gguf: Path, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.fix_serving import greedy_reference

    corpus, prompts = tmp_path / "code.jsonl", tmp_path / "prompts.jsonl"
    # the store also holds the tiny model's own greedy continuations: crest's drafts are accepted, M > 1
    model, hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir)), smollm2_tokenizer.hf
    answers = [p + hf.decode(greedy_reference(model, hf.encode(p, add_special_tokens=False), 12)) for p in PROMPTS]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in [CORPUS, *answers * 3]), encoding="utf-8")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS), encoding="utf-8")
    ingest([str(corpus)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    args = ["bench", "serve", "--model", str(tiny_dir), "--prompts", str(prompts), "--concurrency", "1,2"]
    args += ["--drafters", "none,prompt,crest+prompt", "--store", "code", "--max-tokens", "12"]
    args += ["--max-draft-tokens", "8", "--json", "--out", str(tmp_path / "out"), "--dsn", db_dsn]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    results = json.loads(done.stdout)
    assert results["benchmark"] == "serve" and results["server_exit_code"] == 0  # drained on SIGTERM, exit 0
    rows = results["rows"]
    assert [(r["mode"], r["drafter"], r["concurrency"]) for r in rows] == [
        ("batch-1", "none", 1), ("batch-1", "prompt", 1), ("batch-1", "crest+prompt", 1),
        ("server", "none", 1), ("server", "none", 2), ("server", "prompt", 1), ("server", "prompt", 2),
        ("server", "crest+prompt", 1), ("server", "crest+prompt", 2),
    ]  # fmt: skip
    tokens = rows[0]["output_tokens"]
    assert 2 <= tokens <= 2 * 12
    for row in rows:
        assert row["requests"] == 2 and row["errors"] == 0
        assert row["output_tokens"] == tokens  # greedy is exact: the same tokens in every mode and drafter
        assert row["same_text_as_none"] == 2
        # M from usage.crest.forward_passes: one token a forward without drafts, more with the store's
        if row["drafter"] == "none":
            assert row["mean_accepted_length"] == pytest.approx(1.0), row
        elif row["drafter"] == "crest+prompt":
            assert row["mean_accepted_length"] > 1.5, row
        else:
            assert row["mean_accepted_length"] >= 1.0, row
        assert row["output_tokens_per_second"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]
        assert 0 <= row["itl_ms_p50"] <= row["itl_ms_p99"]
    assert {"figure": "errors under load", "value": 0} in results["comparisons"]
    out = tmp_path / "out"
    assert json.loads((out / "serve.json").read_text())["rows"] == rows
    assert "## Comparisons" in (out / "serve.md").read_text()
    assert (out / "serve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--concurrency", "1,x"], "comma-separated list of integers"),
        (["--concurrency", "0"], "positive integers"),
        (["--drafters", "none,rest"], "unknown drafter 'rest' here"),
        (["--drafters", "crest"], "needs --store"),
        (["--max-tokens", "0"], "must be positive"),
    ],
    ids=["bad-level", "zero-level", "unknown-drafter", "crest-without-store", "no-tokens"],
)
def test_bench_serve_refuses_bad_options(extra: list[str], message: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n", encoding="utf-8")
    args = ["bench", "serve", "--prompts", str(prompts), "--url", "http://127.0.0.1:9", "--drafters", "none"]
    done = CliRunner().invoke(app, [*args, *extra])  # the last --drafters wins
    assert done.exit_code != 0 and isinstance(done.exception, ConfigError)
    assert message in str(done.exception)


def _row(drafter: str, concurrency: int, tps: float, *, mode: str = "server", speedup: float | None = None) -> Any:
    return ServeFigures(mode, drafter, concurrency, 4, 0, 40, 1.0, tps, 4.0, 1, 1, 1, 1, 1, 1, 1.0, speedup)


def test_comparisons_against_none_and_batch_1() -> None:
    rows = [
        _row("none", 1, 10.0, mode="batch-1"),
        _row("none", 1, 10.0, speedup=1.0),
        _row("crest+prompt", 1, 14.0, speedup=1.4),
        _row("none", 16, 30.0, speedup=1.0),
        _row("crest+prompt", 16, 27.0, speedup=0.9),
    ]
    found = {c["figure"]: c["value"] for c in comparisons(rows)}
    assert found["concurrency 1: crest+prompt tokens/s over none"] == 1.4
    assert found["concurrency 16: crest+prompt tokens/s over none"] == 0.9
    assert found["concurrency 16: none tokens/s over batch-1 decoding"] == 3.0
    assert found["errors under load"] == 0
    assert all(set(c) == {"figure", "value"} for c in comparisons(rows))  # figures only: targets live in the docs
    assert check_levels("16,1,4,4") == [1, 4, 16]


def test_drive_a_running_server_by_url(tiny_served: Any, smollm2_tokenizer: Any) -> None:
    from crest.bench.serve import run_serve_bench
    from tests.fix_serving import start

    running = start(tiny_served, smollm2_tokenizer, None, max_batch=4)
    try:
        run = run_serve_bench(PROMPTS * 2, url=running.url, drafters=["none", "prompt"], levels=[3], max_tokens=8,
                              baseline=False)  # fmt: skip
    finally:
        running.stop()
    assert run.server_exit_code is None  # not started here
    none, prompt = run.rows
    assert (none.drafter, none.concurrency, prompt.drafter) == ("none", 3, "prompt")
    assert none.requests == prompt.requests == 4 and none.errors == prompt.errors == 0
    assert none.output_tokens == prompt.output_tokens and prompt.same_text_as_none == 4
    assert none.mean_accepted_length == 1.0 and prompt.speedup_vs_none is not None


def test_a_run_against_another_server_counts_its_texts_against_a_saved_reference(
    tiny_served: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from tests.fix_serving import start

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2), encoding="utf-8")
    running = start(tiny_served, smollm2_tokenizer, None, max_batch=4)
    try:
        common = ["bench", "serve", "--url", running.url, "--prompts", str(prompts), "--concurrency", "1,2"]
        common += ["--max-tokens", "8", "--no-baseline", "--json"]
        ref = CliRunner().invoke(app, [*common, "--drafters", "none", "--label", "plain", "--out", str(tmp_path / "a")])
        assert ref.exit_code == 0, ref.output
        saved = json.loads((tmp_path / "a" / "texts.json").read_text())
        assert [(t["drafter"], t["concurrency"], len(t["texts"])) for t in saved] == [("plain", 1, 4), ("plain", 2, 4)]
        args = [*common, "--drafters", "prompt", "--label", "lookup", "--reference", str(tmp_path / "a")]
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 0, done.output
        rows = json.loads(done.stdout)["rows"]
        assert [(r["drafter"], r["same_text_as_none"]) for r in rows] == [("lookup", 4), ("lookup", 4)]
        assert all(r["speedup_vs_none"] > 0 for r in rows)
        wrong = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "missing")])
        assert isinstance(wrong.exception, ConfigError) and "not a `crest bench serve --out` folder" in str(
            wrong.exception
        )
    finally:
        running.stop()
