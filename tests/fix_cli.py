"""Running the CLI in tests: `run` calls `crest.cli.main()` in this process (the same error mapping as the `crest`
script) and returns its exit code and output, `run_cli` runs `python -m crest.cli` as a subprocess, and
`one_error_line` checks that stderr is one clean `Error: ...` line and returns it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crest.cli.app import main


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `crest ARGS` through main(); return the exit code, stdout and stderr."""
    monkeypatch.setattr(sys, "argv", ["crest", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out, captured.err


def one_error_line(err: str) -> str:
    """Return stderr's one line, after checking it is a clean `Error: ...` message and nothing more."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err and "unexpected" not in err, err
    return lines[0]


def run_cli(*args: str, dsn: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m crest.cli ARGS` against `dsn` (and CREST_HOME `home`); return the finished process."""
    env = {**os.environ, "CREST_DATABASE_URL": dsn, **({"CREST_HOME": str(home)} if home else {})}
    return subprocess.run(
        [sys.executable, "-m", "crest.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


class Terminal(io.StringIO):
    """Standard input that says it is a terminal (what a user types is its text)."""

    def isatty(self) -> bool:
        return True
