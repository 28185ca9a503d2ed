"""Commands of the learning tier: `crest learn` (append transcripts), `crest refresh` (build the live version) and
`crest forget` (delete what a store learned and its live versions)."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Annotated

import typer

from crest.cli.options import Dsn, Json, StoreName
from crest.cli.store_commands import database
from crest.config import DEFAULT_LEARN_DENSE_WINDOW, DEFAULT_LEARN_WINDOW, DEFAULT_TOP_T

Window = Annotated[
    int,
    typer.Option(
        "--window",
        "--learn-window",
        envvar="CREST_LEARN_WINDOW",
        show_envvar=True,
        help="Build the live version from the store's last W learned tokens.",
    ),
]

DenseWindow = Annotated[
    int,
    typer.Option(
        "--dense-window",
        "--learn-dense-window",
        envvar="CREST_LEARN_DENSE_WINDOW",
        show_envvar=True,
        help="With a dense part: the live version's holds the last N hidden states servers recorded (0: none).",
    ),
]


def learn(
    files: Annotated[
        list[str], typer.Argument(metavar="FILES", help="JSONL transcripts (tokens, text, prompt+completion) or text.")
    ],
    store: StoreName,
    source: Annotated[str, typer.Option(help="Recorded as the rows' source.")] = "file",
    dsn: Dsn = None,
) -> None:
    """Append served transcripts to a store's learned log, tokenized with the store's tokenizer.

    A .jsonl (or .ndjson) file holds one record a line: {"tokens": [ids]} (with "prompt_tokens": K, the
    leading ids that were context), {"text": "..."}, or {"prompt": "...", "completion": "..."} (or
    "response"); any other file is one plain-text transcript. Every file is checked before anything is
    written: a bad line appends nothing. `crest refresh` builds them into the live version.
    """
    from crest.learning import learn_files

    found = learn_files(database(dsn), store, files, source=source)
    rows = len(found.token_lists)
    typer.echo(f"learned {rows:,} rows ({found.tokens:,} tokens) from {found.files:,} files for store {store!r}")


def refresh(
    store: StoreName,
    window: Window = DEFAULT_LEARN_WINDOW,
    dense_window: DenseWindow = DEFAULT_LEARN_DENSE_WINDOW,
    min_new_tokens: Annotated[
        int, typer.Option(help="Skip unless at least this many tokens were learned since the live version.")
    ] = 0,
    min_count: Annotated[int, typer.Option(help="Keep the n-grams seen at least this often in the window.")] = 2,
    max_ngrams: Annotated[int, typer.Option(help="Keep at most this many n-grams of each n.")] = DEFAULT_TOP_T,
    full: Annotated[
        bool, typer.Option("--full", help="Rebuild every row instead of copying the unchanged ones from the last.")
    ] = False,
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Build a store's live version from what it learned and publish it, replacing the previous live version.

    Prints "nothing new" when nothing was learned since the published live version (or another refresh of the
    store is running). The static version is untouched; a failed or interrupted refresh leaves the previous
    live version published.
    """
    import dataclasses
    import json

    from crest.learning import refresh_live

    done = refresh_live(
        database(dsn),
        store,
        window=window,
        dense_window=dense_window,
        min_new_tokens=min_new_tokens,
        min_count=min_count,
        max_ngrams=max_ngrams,
        incremental=not full,
    )
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(done) if done else None))
    elif done is None:
        typer.echo(f"store {store!r}: nothing new")
    else:
        size = (done.table_bytes + done.index_bytes) / 1e6
        typer.echo(
            f"store {store!r}: live version {done.store_id} published from learned rows"
            f" {done.from_id}..{done.through_id} ({done.rows:,} rows, {done.tokens:,} tokens,"
            f" {done.new_rows:,} new): {done.ngrams:,} n-grams, {size:,.1f} MB;"
            f" {done.mode} build, {done.reused:,} rows copied, {done.built:,} built in {done.seconds:.1f} s"
            + (f"; {done.dense_rows:,} dense entries" if done.dense_rows else "")
        )


def forget(
    store: StoreName,
    before: Annotated[
        str | None,
        typer.Option(help="Only rows learned before this time (ISO 8601; without an offset: local time)."),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dsn: Dsn = None,
) -> None:
    """Delete what a store learned (all of it, or the rows learned before TIME) and drop its live versions.

    Every live version is dropped, since it may hold n-grams of any learned row; the static version stays.
    The next `crest refresh` rebuilds the live version from the rows that are left.
    """
    from crest.errors import ConfigError
    from crest.learning import forget as run_forget

    when = None
    if before is not None:
        try:
            when = datetime.fromisoformat(before.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(
                f"--before {before!r} is not an ISO 8601 time such as 2026-01-31T12:00:00+00:00"
            ) from None
        try:
            when = when if when.tzinfo is not None else when.astimezone()  # a time without an offset is local
        except (ValueError, OverflowError):
            raise ConfigError(f"--before {before!r} is out of range as a local time: give an offset") from None
    url = database(dsn)
    what = f"rows learned before {when.isoformat()}" if when else "everything it learned"
    if not yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                f"crest forget --store {store} asks for confirmation and stdin is not a terminal: add --yes"
            )
        typer.confirm(f"Forget {what} for store {store!r} and drop its live versions?", abort=True)
    done = run_forget(url, store, before=when)
    versions = ", ".join(str(v) for v in done.versions) or "none"
    typer.echo(f"store {store!r}: forgot {done.rows:,} learned rows; live versions dropped: {versions}")
