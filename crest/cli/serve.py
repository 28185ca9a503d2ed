"""`crest serve`: an OpenAI-compatible server with continuous batching, drafting from the store for every request.

The command parses its options and calls `crest.serving.server.serve`, which checks them and the store before
the model loads, loads the model once and serves until SIGTERM (exit 0, in-flight requests drained) or Ctrl-C
(130). By default the server learns: finished requests are written to their store's learned log and the live
tiers of its stores are rebuilt every `--refresh-interval` seconds.
"""

from __future__ import annotations

from typing import Annotated

import typer

from crest.cli.options import Device, Dsn, Dtype, MaxDraftTokens, Model, OptionalStore, ReadDsn
from crest.config import (
    DEFAULT_DRAFTER,
    DEFAULT_LEARN_DENSE_WINDOW,
    DEFAULT_LEARN_WINDOW,
    DEFAULT_REFRESH_INTERVAL,
    DEFAULT_REFRESH_MIN_TOKENS,
)


def serve(
    model: Model = "smollm2",
    store: OptionalStore = None,
    drafter: Annotated[
        str, typer.Option(envvar="CREST_DRAFTER", help="Default drafter (per request: drafter); see `crest drafters`.")
    ] = DEFAULT_DRAFTER,
    host: Annotated[str, typer.Option(envvar="CREST_HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="CREST_PORT", help="Port to listen on.")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Requests decoded together at most (rows of a step).")] = 8,
    max_queue: Annotated[int, typer.Option(help="Requests waiting for a row at most; beyond: 429.")] = 64,
    max_draft_tokens: MaxDraftTokens = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    api_key: Annotated[
        str | None, typer.Option(envvar="CREST_API_KEY", help="Require 'Authorization: Bearer KEY' (not /health).")
    ] = None,
    dsn: Dsn = None,
    read_dsn: ReadDsn = None,
    learn: Annotated[
        bool,
        typer.Option(envvar="CREST_LEARN", help="Write finished requests' tokens to their store (per request: learn)."),
    ] = True,
    learn_window: Annotated[
        int,
        typer.Option(envvar="CREST_LEARN_WINDOW", help="Refreshes build the live tier from the last W learned tokens."),
    ] = DEFAULT_LEARN_WINDOW,
    learn_dense_window: Annotated[
        int,
        typer.Option(
            envvar="CREST_LEARN_DENSE_WINDOW",
            help="With a dense part, refreshes build the live tier's from the last N recorded hidden states.",
        ),
    ] = DEFAULT_LEARN_DENSE_WINDOW,
    refresh_interval: Annotated[
        float,
        typer.Option(envvar="CREST_REFRESH_INTERVAL", help="Seconds between live-tier refreshes (0: never, here)."),
    ] = DEFAULT_REFRESH_INTERVAL,
    refresh_min_tokens: Annotated[
        int,
        typer.Option(envvar="CREST_REFRESH_MIN_TOKENS", help="New learned tokens a refresh waits for."),
    ] = DEFAULT_REFRESH_MIN_TOKENS,
) -> None:
    """Serve the OpenAI API (completions, chat completions) with continuous batching and store drafts."""
    from crest.drafting.hub import LearnOptions
    from crest.serving.server import ServeOptions
    from crest.serving.server import serve as serve_forever

    learning = LearnOptions(
        record=learn,
        window=learn_window,
        refresh_interval=refresh_interval,
        refresh_min_tokens=refresh_min_tokens,
        dense_window=learn_dense_window,
    )
    options = ServeOptions(
        model=model, store=store, drafter=drafter, host=host, port=port, max_batch=max_batch, max_queue=max_queue,
        max_draft_tokens=max_draft_tokens, device=device, dtype=dtype, api_key=api_key, dsn=dsn, read_dsn=read_dsn,
        learning=learning,
    )  # fmt: skip
    serve_forever(options, on_progress=lambda line: typer.echo(line, err=True))
