"""The report of a `crest bench` run: its results printed (a table, or one JSON line), and the files `--out` wrote
named. Only the `crest bench` commands use it, so the product's display never imports the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from crest.bench.results import save_run
from crest.cli.display import json_value, print_figures, print_rows


def report_run(
    benchmark: str,
    rows: list[dict[str, Any]],
    *,
    started: float,
    title: str,
    as_json: bool,
    out: Path | None,
    **extra: Any,
) -> None:
    """Print a benchmark's results (a table, or one JSON line) and name the files they were written to."""
    results, paths = save_run(benchmark, rows, started=started, title=title, out=out, **extra)
    if as_json:
        print(json.dumps(results, default=json_value), flush=True)
    elif len(rows) == 1:
        print_figures(title, rows[0])
    else:
        print_rows(title, rows)
    for path in paths:
        typer.echo(f"wrote {path}", err=True)
