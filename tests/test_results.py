"""One results format for every `crest bench` command: the JSON envelope, the markdown table, `--out`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crest.cli import app
from crest.errors import CrestError
from crest.results import envelope, markdown, write_results
from tests.test_store import ROWS, publish


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
def test_markdown_tables(rows: list[dict[str, object]], lines: list[str]) -> None:
    text = markdown(envelope("x", rows, started=time.time()), title="T")
    assert text.startswith("# T\n") and "Command: `crest " in text
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
    assert figures["meets_miss_ratio_target"] == (figures["miss_ratio"] <= 1.3)
    assert "| miss_ratio |" in (out / "lookup.md").read_text()
