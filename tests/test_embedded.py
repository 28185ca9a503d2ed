"""The embedded default server: started once, found by other processes, robust to stale pid files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from crest_client.embedded import crest_home, embedded_dsn, stop_embedded


@pytest.fixture()
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # a short path: the server's unix socket lives in the data directory
    path = Path(tmp_path_factory.mktemp("h"))
    yield path
    stop_embedded(path)


def _version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    assert row is not None
    return str(row[0])


def test_crest_home_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CREST_HOME", str(tmp_path / "x"))
    assert crest_home() == tmp_path / "x"


def test_second_process_finds_the_running_server(home: Path) -> None:
    dsn = embedded_dsn(home)
    assert _version(dsn).split(".")[0].isdigit()
    code = "import sys; from crest_client.embedded import embedded_dsn; print(embedded_dsn())"
    env = {**os.environ, "CREST_HOME": str(home)}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == dsn
    pid = (home / "pgdata" / "postmaster.pid").read_text().split()[0]
    assert embedded_dsn(home) == dsn
    assert (home / "pgdata" / "postmaster.pid").read_text().split()[0] == pid  # same server, not restarted


def test_stale_pid_file_is_replaced(home: Path) -> None:
    embedded_dsn(home)
    assert stop_embedded(home)
    pidfile = home / "pgdata" / "postmaster.pid"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pidfile.write_text(f"{dead.stdout.strip()}\n{home / 'pgdata'}\n0\n5432\n\n\n\nstopping\n")
    dsn = embedded_dsn(home)
    assert _version(dsn)


def test_stop_when_not_running(home: Path) -> None:
    assert stop_embedded(home) is False
