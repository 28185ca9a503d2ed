"""One results format for every `crest bench` command: the JSON envelope, the markdown table, `--out`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crest.bench.results import envelope, markdown, write_results
from crest.cli.app import app, main
from crest.errors import CrestError
from tests.fix_store import ROWS, publish


def test_envelope_records_command_versions_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["crest", "bench", "lookup", "--store", "my store"])
    results = envelope("lookup", [{"a": 1.5}], started=time.time() - 2, store="s")
    assert results["benchmark"] == "lookup" and results["store"] == "s" and results["rows"] == [{"a": 1.5}]
    assert results["command"] == "crest bench lookup --store 'my store'"  # shell-quoted, so it runs again as is
    assert {"crest", "crest-client", "torch", "numpy", "python"} <= set(results["versions"])
    assert 1.5 < results["seconds"] < 60 and results["started_at"].endswith("+00:00")


@pytest.mark.parametrize(
    ("rows", "lines"),
    [
        ([{"samples": 3, "miss_ratio": 1.25}], ["| figure | value |", "| samples | 3 |", "| miss_ratio | 1.250 |"]),
        (
            [{"drafter": "none", "tokens_per_second": 13.25}, {"drafter": "prompt", "tokens_per_second": None}],
            ["| drafter | tokens_per_second |", "| none | 13.2 |", "| prompt | - |"],
        ),
    ],
    ids=["one-row-as-figures", "rows-as-table"],
)
def test_markdown_tables(rows: list[dict[str, object]], lines: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["crest", "bench", "x"])  # a pytest-xdist worker's own argv is bare
    text = markdown(envelope("x", rows, started=time.time()), title="T")
    assert text.startswith("# T\n") and "Command: `crest bench x`" in text
    for line in lines:
        assert line in text.splitlines()


def test_write_results_refuses_an_unwritable_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CrestError, match="cannot write benchmark results"):
        write_results(envelope("x", [], started=time.time()), blocker / "out", title="T")


def test_bench_lookup_writes_json_and_markdown(db_dsn: str, tmp_path: Path) -> None:
    publish(db_dsn, "demo", ROWS)
    out = tmp_path / "results"
    args = ["bench", "lookup", "--store", "demo", "--samples", "4", "--json", "--out", str(out), "--dsn", db_dsn]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    printed = json.loads(done.stdout)
    saved = json.loads((out / "lookup.json").read_text())
    assert saved["rows"] == printed["rows"] and saved["benchmark"] == "lookup" and saved["store"] == "demo"
    (figures,) = saved["rows"]
    assert figures["samples"] == len(ROWS) and figures["hit_rate_of_contexts"] == 1.0
    assert min(figures["bare_median_us"], figures["miss_median_us"], figures["hit_median_us"]) > 0
    assert figures["miss_ratio"] == pytest.approx(figures["miss_median_us"] / figures["bare_median_us"])
    assert not any(key.startswith("meets_") for key in figures)  # figures only: docs/benchmarks.md compares them
    assert "| miss_ratio |" in (out / "lookup.md").read_text()


def _line(prompt: int, drafter: str, seconds: float, forwards: int, identical: bool = True) -> str:
    row = {"prompt": prompt, "drafter": drafter, "new_tokens": 10, "seconds": seconds}
    row |= {"forward_passes": forwards, "draft_seconds": 0.001 * forwards, "identical": identical}
    return json.dumps(row)


def test_generate_figures_from_records_leave_out_an_unfinished_prompt(tmp_path: Path) -> None:
    records = tmp_path / "run.jsonl"
    lines = [_line(0, "generate", 1.0, 10), _line(0, "prompt", 0.5, 4, identical=False)]
    lines += [_line(1, "generate", 1.0, 10), _line(1, "prompt", 0.5, 6), _line(2, "generate", 9.0, 10)]
    records.write_text("\n".join(lines) + "\n\n")  # prompt 2: the run stopped before `prompt` finished it
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["bench", "generate", "--from-records", str(records), "--json", "--out", str(out)])
    assert done.exit_code == 0, done.output
    generate, prompt = json.loads(done.stdout)["rows"]
    assert generate["prompts"] == prompt["prompts"] == 2 and generate["tokens_per_second"] == pytest.approx(10.0)
    assert prompt["tokens_per_second"] == pytest.approx(20.0) and prompt["speedup_vs_generate"] == pytest.approx(2.0)
    assert prompt["mean_accepted_length"] == pytest.approx(2.0) and prompt["exact_matches"] == 1
    assert prompt["draft_ms_median"] == pytest.approx(1.0)
    assert "| prompt | 2 | 20 |" in (out / "generate.md").read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json\n", "not valid JSON"), ('{"prompt": 0}\n', "not a bench generate record")],
    ids=["not-json", "missing-keys"],
)
def test_bad_records_are_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    records = tmp_path / "run.jsonl"
    records.write_text(text)
    monkeypatch.setattr("sys.argv", ["crest", "bench", "generate", "--from-records", str(records)])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and "run.jsonl" in err and message in err and "Traceback" not in err
