"""Benchmark results in one format for every `crest bench` command.

Each run's figures go into one envelope: the benchmark's name, the exact command line, the versions of crest
and of the libraries the figures depend on, when the run started and how long it took, and its rows (one row
per drafter or per measurement; one row for the single-figure benchmarks). The envelope is printed as a table,
printed as JSON with `--json`, and written with `--out DIR` as `DIR/<benchmark>.json` plus a markdown table
`DIR/<benchmark>.md`. `crest bench accept` writes the same envelope with more keys, and its plots.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from crest.errors import CrestError


def versions() -> dict[str, str]:
    """Return the versions of crest, Python and the libraries the figures depend on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("crest", "crest-client", "torch", "transformers", "numpy", "psycopg", "tokenizers"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "-"
    return found


def command_line(argv: Sequence[str] | None = None) -> str:
    """Return the command line that started this run, as a shell would take it back."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["crest", *args])


def started_at(started: float) -> str:
    """Return a `time.time()` value as an ISO 8601 UTC timestamp to the second."""
    return datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds")


def envelope(benchmark: str, rows: Sequence[dict[str, Any]], *, started: float, **extra: Any) -> dict[str, Any]:
    """Return the results of one run; `started` is its `time.time()` at the start."""
    return {
        "benchmark": benchmark,
        "command": command_line(),
        "versions": versions(),
        "started_at": started_at(started),
        "seconds": round(time.time() - started, 3),
        **extra,
        "rows": [dict(row) for row in rows],
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return "-" if value is None else str(value)


def markdown(results: dict[str, Any], *, title: str) -> str:
    """Return the run as markdown: title, command, versions, then the rows as a table."""
    rows = results["rows"]
    lines = [f"# {title}", "", f"Command: `{results['command']}`", ""]
    lines += [f"Started {results['started_at']}, {results['seconds']:.1f} s. Versions: "]
    lines[-1] += ", ".join(f"{k} {v}" for k, v in results["versions"].items() if k != "platform") + "."
    lines.append("")
    if len(rows) == 1:  # one measurement: a figure per line reads better than one wide row
        lines += ["| figure | value |", "| --- | --- |"]
        lines += [f"| {key} | {_cell(value)} |" for key, value in rows[0].items()]
    elif rows:
        keys = list(rows[0])
        lines += ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
        lines += ["| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], out: Path, *, title: str) -> list[Path]:
    """Write `<benchmark>.json` and `<benchmark>.md` into `out` (created); return the paths."""
    name = results["benchmark"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{name}.json", out / f"{name}.md"]
        paths[0].write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
        paths[1].write_text(markdown(results, title=title), encoding="utf-8")
    except OSError as exc:
        raise CrestError(f"cannot write benchmark results to {out}: {exc.strerror or exc}") from None
    return paths


def save_run(
    benchmark: str,
    rows: Sequence[dict[str, Any]],
    *,
    started: float,
    title: str,
    out: Path | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], list[Path]]:
    """Return a run's envelope and the files it was written to (`out`/<benchmark>.json and .md; none without `out`)."""
    results = envelope(benchmark, rows, started=started, **extra)
    return results, write_results(results, out, title=title) if out is not None else []


def append_notes(path: Path, lines: Sequence[str]) -> None:
    """Add `lines` under the markdown table a run wrote to `path` (its figures in words, its method)."""
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(["", *lines]) + "\n")
    except OSError as exc:
        raise CrestError(f"cannot write {path}: {exc.strerror or exc}") from None


def open_records(path: Path) -> TextIO:
    """Open the JSON-lines file a benchmark writes its records to as it goes, or raise a clear error."""
    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise CrestError(f"cannot write {path}: {exc.strerror or exc}") from None
