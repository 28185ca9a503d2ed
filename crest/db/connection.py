"""Connections to PostgreSQL and the schema's migrations.

`connect` and `session` turn connection and statement failures into a DatabaseError that names the server (its
password masked); `upgrade` runs the Alembic migrations, shipped in the wheel as `crest.migrations`, under an
advisory lock so that two processes migrating at once take turns; `schema_revision` and `head_revision` say
where a database is and where `upgrade` would bring it, without migrating (for commands that only read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

import psycopg

from crest.errors import DatabaseError

MIGRATIONS = "crest.migrations"  # the top-level migrations/ folder, mapped into the package
_MIGRATE_LOCK = 0x4352_0001


def connect(dsn: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """Open a connection, turning failures into a DatabaseError that names the server."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10, application_name="crest")
    except psycopg.Error as exc:
        raise DatabaseError(f"cannot connect to the database ({_safe_dsn(dsn)}): {exc}".strip()) from None


@contextmanager
def session(dsn: str, *, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
    """Yield a connection that is closed afterwards; database errors become DatabaseError."""
    conn = connect(dsn, autocommit=autocommit)
    try:
        yield conn
    except psycopg.Error as exc:
        raise DatabaseError(f"database error: {str(exc).strip()}") from None
    finally:
        conn.close()


def upgrade(dsn: str, *, revision: str = "head") -> str | None:
    """Run the Alembic migrations up to `revision`; return the revision now current."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine("postgresql+psycopg://", creator=lambda: connect(dsn), poolclass=NullPool)
    config = Config()
    try:
        config.set_main_option("script_location", str(resources.files(MIGRATIONS)))
        with engine.begin() as connection:
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATE_LOCK})")
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
            context = MigrationContext.configure(connection, opts={"version_table": "crest_alembic_version"})
            return context.get_current_revision()
    except DatabaseError:
        raise
    except Exception as exc:
        raise DatabaseError(f"could not migrate the database schema: {exc}") from None
    finally:
        engine.dispose()


def schema_revision(dsn: str) -> str | None:
    """Return the migration the database's crest schema is at (None: no crest schema yet); reads only."""
    with session(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass('crest_alembic_version') IS NOT NULL").fetchone()
        if row is None or not row[0]:
            return None
        found = conn.execute("SELECT version_num FROM crest_alembic_version").fetchone()
    return str(found[0]) if found else None


def head_revision() -> str | None:
    """Return the newest migration this crest ships (what `upgrade` brings a database to)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(resources.files(MIGRATIONS)))
    return ScriptDirectory.from_config(config).get_current_head()


def _safe_dsn(dsn: str) -> str:
    """Return the DSN with any password masked, for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<unparsable DSN>"
    if info.get("password"):
        info["password"] = "***"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
