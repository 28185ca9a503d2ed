"""The embedded default server: started once, found by other processes, robust to stale pid files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from crest_client.embedded import crest_home, embedded_dsn, stop_embedded


@pytest.fixture()
def home() -> Iterator[Path]:
    # a short path (the server's unix socket lives in the data directory), outside pytest's own 0700 tree: the
    # server runs as another user when tests run as root, and initdb failed there once under load (Permission denied)
    path = Path(tempfile.mkdtemp(prefix="crest-emb-"))
    yield path
    stop_embedded(path)
    shutil.rmtree(path, ignore_errors=True)


def _version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG user data dir is Linux's")
def test_crest_home_is_the_environment_else_the_user_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("CREST_HOME", "~/crest-data")
    assert crest_home() == tmp_path / "user" / "crest-data"
    monkeypatch.delenv("CREST_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert crest_home() == tmp_path / "xdg" / "crest"


def test_server_start_and_stop_use_crest_home(home: Path) -> None:
    """`crest server start` puts the server's data in $CREST_HOME/pgdata; `crest server stop` stops that server."""
    env = {**os.environ, "CREST_HOME": str(home)}
    started = subprocess.run([sys.executable, "-m", "crest.cli", "server", "start"], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert (home / "pgdata" / "postmaster.pid").exists()
    assert _version(started.stdout.strip())
    stopped = subprocess.run([sys.executable, "-m", "crest.cli", "server", "stop"], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert (stopped.returncode, stopped.stdout) == (0, "stopped\n"), stopped.stderr
    assert not (home / "pgdata" / "postmaster.pid").exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(started.stdout.strip(), connect_timeout=2).close()


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
