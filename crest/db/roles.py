"""Least-privilege roles: a reader role for inference servers (reads, appends what it served) and a writer role.

`create_roles` (the `crest db roles` command; `sql/roles.sql` is the same for psql) migrates the schema,
creates or updates two LOGIN roles and sets their privileges, and is safe to run again. The writer owns
crest's tables and function (attaching and dropping partitions needs ownership), may create tables in the
schema, and nothing else. The reader may connect, use the schema and SELECT crest's tables: the existing ones
and, through `ALTER DEFAULT PRIVILEGES FOR ROLE writer`, every table the writer creates later (each store
version's partitions, `crest_store_data`), and INSERT into `crest_learned`, the log of served tokens a server
appends to: its data columns only (tokens and the request's figures), so ids and times stay the server's (an
identity column needs no sequence privilege). It cannot update or delete, write any other table, create, drop
or use any other schema. On PostgreSQL < 15, where PUBLIC may create in schema public, that right is revoked
from PUBLIC (what 15 does by default). Every identifier is quoted with
`psycopg.sql.Identifier`; passwords are sent as quoted literals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import psycopg
from crest_client.learner import DENSE as LEARNED_DENSE
from crest_client.learner import STATS as LEARNED_STATS
from psycopg import sql

from crest import db
from crest.config import check_store_name
from crest.errors import ConfigError, DatabaseError

LEARNED_INSERT_COLUMNS = (
    *("store", "tokens", "n_tokens", "prompt_tokens", "source"),
    *LEARNED_STATS,
    "accepted_parts",
    *LEARNED_DENSE,
)


@dataclass
class RolesReport:
    """What `create_roles` did."""

    reader: str
    writer: str
    schema: str
    created: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)


_RIGHTS = ("SUPERUSER", "CREATEDB", "CREATEROLE", "REPLICATION", "BYPASSRLS")


def check_role_name(name: str, label: str) -> str:
    """Return `name` when it is a plain identifier, else raise ConfigError."""
    try:
        check_store_name(name)
    except Exception:
        raise ConfigError(f"{label} role name {name!r} is not a plain identifier") from None
    if label != "schema" and (name.lower() == "public" or name.lower().startswith("pg_")):
        raise ConfigError(f"{label} role name {name!r} is reserved by PostgreSQL")
    return name


def password_from_env(variable: str | None) -> str | None:
    """Return the password held by environment variable `variable` (None when no variable is named)."""
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"environment variable {variable!r} holds no password")
    return value


def create_roles(
    dsn: str,
    *,
    reader: str = "crest_reader",
    writer: str = "crest_writer",
    schema: str = "public",
    reader_password: str | None = None,
    writer_password: str | None = None,
) -> RolesReport:
    """Create or update the reader and writer roles and their privileges (needs a role that may create roles)."""
    check_role_name(reader, "reader")
    check_role_name(writer, "writer")
    check_role_name(schema, "schema")
    if reader == writer:
        raise ConfigError("the reader and writer roles must differ")
    db.upgrade(dsn)
    report = RolesReport(reader=reader, writer=writer, schema=schema)
    try:
        with db.connect(dsn) as conn, conn.transaction():
            for role, password in ((reader, reader_password), (writer, writer_password)):
                if _ensure_role(conn, role, password):
                    report.created.append(role)
            report.tables = _grant(conn, reader=reader, writer=writer, schema=schema)
    except psycopg.Error as exc:
        raise DatabaseError(f"could not set up roles {reader!r} and {writer!r}: {str(exc).strip()}") from None
    return report


def _ensure_role(conn: psycopg.Connection[Any], role: str, password: str | None) -> bool:
    """Create `role` as a plain LOGIN role, or reset an existing one; return whether it was created."""
    found = conn.execute(
        "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls, rolname = current_user"
        " FROM pg_roles WHERE rolname = %s",
        (role,),
    ).fetchone()
    if found is not None:  # resetting it would take those rights away from whoever uses it now
        rights = [r for r, held in zip(_RIGHTS, found[:5], strict=True) if held]
        if found[5] or rights:
            held = "is the role connected now" if found[5] else f"holds {', '.join(rights)}"
            raise ConfigError(f"role {role!r} exists and {held}: crest's roles hold no such right, name another role")
    exists = found is not None
    verb = "ALTER" if exists else "CREATE"
    options: sql.Composable = sql.SQL("LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT")
    if password is not None:
        options = sql.SQL("{} PASSWORD {}").format(options, sql.Literal(password))
    conn.execute(sql.SQL(verb + " ROLE {} WITH {}").format(sql.Identifier(role), options))
    return not exists


def _grant(conn: psycopg.Connection[Any], *, reader: str, writer: str, schema: str) -> list[str]:
    """Hand crest's objects to the writer, let the reader SELECT them now and later; return the tables."""
    r, w, s = sql.Identifier(reader), sql.Identifier(writer), sql.Identifier(schema)
    dbname = sql.Identifier(conn.info.dbname)
    if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None:
        raise ConfigError(f"schema {schema!r} does not exist")
    if conn.info.server_version < 150000:
        conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA {} FROM PUBLIC").format(s))
    conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}, {}").format(dbname, r, w))
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
    conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(s, w))
    conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(s, r))
    tables = [
        name
        for (name,) in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace"
            " WHERE ns.nspname = %s AND c.relkind IN ('r', 'p') AND c.relname LIKE 'crest\\_%%' ORDER BY c.relname",
            (schema,),
        )
    ]
    for name in tables:
        table = sql.Identifier(schema, name)
        conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(table, w))
        conn.execute(sql.SQL("REVOKE ALL ON TABLE {} FROM {}").format(table, r))
        conn.execute(sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(table, r))
    if "crest_learned" in tables:  # not id nor created_at: the log's order and times are the server's
        conn.execute(
            sql.SQL("GRANT INSERT ({}) ON TABLE {} TO {}").format(
                sql.SQL(", ").join(map(sql.Identifier, LEARNED_INSERT_COLUMNS)),
                sql.Identifier(schema, "crest_learned"),
                r,
            )
        )
    for (signature,) in conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace ns ON ns.oid = p.pronamespace"
        " WHERE ns.nspname = %s AND p.proname LIKE 'crest\\_%%'",
        (schema,),
    ).fetchall():  # the server's own quoting of `name(argument types)`
        conn.execute(sql.SQL("ALTER FUNCTION {} OWNER TO {}").format(sql.SQL(signature), w))
    conn.execute(
        sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT SELECT ON TABLES TO {}").format(w, s, r)
    )
    return tables
