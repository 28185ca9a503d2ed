"""The `crest` command line: parses options (option > CREST_* environment variable > default) and calls the library.

`main` is the only place that turns failures into exit codes: 0 success, 1 a failure that is neither bad
input nor the database, 2 usage or bad input (click's own usage message for unknown options, missing
arguments and unknown commands), 3 the database, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: docker stop,
systemd; a command cleans up as on Ctrl-C). Every failure the user can cause ends
with a one-line message on stderr, never a traceback (set CREST_DEBUG=1 to see one).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from crest.cli.answer import answer
from crest.cli.bench_commands import bench_app, rest_app
from crest.cli.db_commands import db_app, server_app
from crest.cli.drafter_commands import drafters
from crest.cli.export_commands import export, export_hf
from crest.cli.generate import generate
from crest.cli.learn_commands import forget, learn, refresh
from crest.cli.serve import serve
from crest.cli.store_commands import drop, ingest, lookup, stores
from crest.errors import (
    EXIT_DATABASE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    CrestClientError,
    exit_code,
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: whatever cleans up after Ctrl-C does after it too."""

    received = False  # typer turns either into Exit(130): this tells them apart afterwards


def _terminate(signum: int, frame: Any) -> None:
    Terminated.received = True
    raise Terminated


class _Commands(TyperGroup):
    """The root command group: a reader that goes away (`crest stores | head -1`) ends a command with exit 0."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # click's own handling would exit 1; what the reader read is all it wanted
            _stop_writing()
            raise typer.Exit(0) from None


# plain click help: rich markup would eat square brackets in help texts ({"tokens": [ids]}, 'crest[spark]') and
# typer's rich panels show a <bool> value for flags, which take none; subcommand groups inherit this mode
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    cls=_Commands,
    help="Compact, database-backed drafting stores for speculative decoding.",
    epilog="Exit codes: 0 ok, 1 failure, 2 usage or bad input, 3 database, 130 interrupted, 143 terminated.",
)
for command in (ingest, lookup, stores, drop, learn, refresh, forget, generate, answer, serve, drafters):
    app.command()(command)
app.command("export-hf")(export_hf)
app.command()(export)
app.add_typer(db_app, name="db")
app.add_typer(server_app, name="server")
app.add_typer(bench_app, name="bench")
app.add_typer(rest_app, name="rest-index")


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("crest")
        except PackageNotFoundError:
            found = "unknown"
        typer.echo(f"crest {found}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print crest's version and exit."),
    ] = False,
) -> None:
    """Compact, database-backed drafting stores for speculative decoding."""


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI and exit with its code; crest's errors become one line on stderr, Ctrl-C exit 130, SIGTERM 143."""
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL + 1)  # its retry lines; the error says why
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None  # `crest serve` sets its own
    Terminated.received = False
    try:
        code = app(args=None if argv is None else list(argv), prog_name="crest", standalone_mode=False)
    except KeyboardInterrupt as exc:
        _fail_interrupted(exc)
    except typer.Abort as exc:  # click turns Ctrl-C (KeyboardInterrupt) and end of input (EOFError) into Abort
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, KeyboardInterrupt):
            _fail_interrupted(cause)
        _fail("aborted", EXIT_FAILURE)
    except CrestClientError as exc:
        _fail(str(exc), exit_code(exc))
    except Exception as exc:
        _fail_unexpected(exc)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    # typer returns the code of an Exit in this mode; Ctrl-C or SIGTERM inside a command is Exit(130)
    if code == EXIT_INTERRUPTED:
        _fail_interrupted(Terminated() if Terminated.received else KeyboardInterrupt())
    sys.exit(code if isinstance(code, int) else 0)


def _fail_interrupted(exc: KeyboardInterrupt) -> NoReturn:
    """Say how the command was stopped: Ctrl-C (130) or SIGTERM (143)."""
    if isinstance(exc, Terminated):
        _fail("terminated", EXIT_TERMINATED)
    _fail("interrupted", EXIT_INTERRUPTED)


def _fail_unexpected(exc: Exception) -> NoReturn:
    """Show click's usage errors as click does (exit 2), psycopg's as a database error, anything else as a bug."""
    show, code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
    if callable(show) and isinstance(code, int):  # click's ClickException (typer vendors click: no isinstance)
        show()
        sys.exit(code)
    psycopg: Any = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(exc, psycopg.Error):
        _fail(f"database error: {exc}", EXIT_DATABASE)
    if os.environ.get("CREST_DEBUG"):
        raise exc
    _fail(f"unexpected {type(exc).__name__}: {exc} (set CREST_DEBUG=1 for a traceback)", EXIT_FAILURE)


def _stop_writing() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush into the closed pipe does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout): nothing is left to flush
        pass


def _fail(message: str, code: int) -> NoReturn:
    line = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    typer.echo(f"Error: {line}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
