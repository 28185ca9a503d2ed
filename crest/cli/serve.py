"""`crest serve`: an OpenAI-compatible server with continuous batching, drafting from the store for every request.

`run_serve` loads the model once, checks it can be batched, measures (or loads) the forward cost model, opens
the default store (a database that is down only costs store drafts until it answers) and runs the FastAPI app
under uvicorn, which drains in-flight requests on SIGTERM or Ctrl-C before the scheduler stops; a drained
SIGTERM exits 0, Ctrl-C 130. By default the server learns: finished requests are written to their store's
learned log and the live tiers of its stores are rebuilt every `--refresh-interval` seconds.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from crest.cli.options import Device, Dsn, Dtype, MaxDraftTokens, Model, OptionalStore, ReadDsn
from crest.config import DEFAULT_LEARN_WINDOW


def serve(
    model: Model = "smollm2",
    store: OptionalStore = None,
    drafter: Annotated[
        str, typer.Option(envvar="CREST_DRAFTER", help="Default drafter (per request: drafter); see `crest drafters`.")
    ] = "crest+prompt",
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
    refresh_interval: Annotated[
        float,
        typer.Option(envvar="CREST_REFRESH_INTERVAL", help="Seconds between live-tier refreshes (0: never, here)."),
    ] = 10.0,
    refresh_min_tokens: Annotated[
        int,
        typer.Option(envvar="CREST_REFRESH_MIN_TOKENS", help="New learned tokens a refresh waits for."),
    ] = 2048,
) -> None:
    """Serve the OpenAI API (completions, chat completions) with continuous batching and store drafts."""
    run_serve(
        model=model,
        store=store,
        drafter=drafter,
        host=host,
        port=port,
        max_batch=max_batch,
        max_queue=max_queue,
        max_draft_tokens=max_draft_tokens,
        device=device,
        dtype=dtype,
        api_key=api_key,
        dsn=dsn,
        read_dsn=read_dsn,
        learn=learn,
        learn_window=learn_window,
        refresh_interval=refresh_interval,
        refresh_min_tokens=refresh_min_tokens,
    )


def run_serve(
    *,
    model: str,
    store: str | None,
    drafter: str,
    host: str,
    port: int,
    max_batch: int,
    max_queue: int,
    max_draft_tokens: int | None,
    device: str,
    dtype: str,
    api_key: str | None,
    dsn: str | None,
    read_dsn: str | None = None,
    learn: bool = True,
    learn_window: int = DEFAULT_LEARN_WINDOW,
    refresh_interval: float = 10.0,
    refresh_min_tokens: int = 2048,
) -> None:
    """Load the model, open the default store and serve until SIGTERM or Ctrl-C (in-flight requests finish)."""
    from crest.config import resolve_model_spec
    from crest.decoding.models import load_model
    from crest.decoding.sizing import calibrate
    from crest.drafters.registry import check_drafter
    from crest.errors import ConfigError
    from crest.ingest.tokenizer import load_tokenizer
    from crest.serving.app import create_app
    from crest.serving.batch import check_batchable
    from crest.serving.engine import Engine
    from crest.serving.learning import LearnOptions
    from crest.serving.scheduler import Scheduler

    drafter = check_drafter(drafter, where="serve", store=store)  # before the model loads
    if max_batch < 1 or max_queue < 0 or not 0 < port < 65536:
        raise ConfigError("--max-batch must be >= 1, --max-queue >= 0 and --port in 1..65535")
    if learn_window < 1 or refresh_interval < 0 or refresh_min_tokens < 0:
        raise ConfigError("--learn-window must be >= 1, --refresh-interval >= 0 and --refresh-min-tokens >= 0")
    learning = LearnOptions(
        record=learn, window=learn_window, refresh_interval=refresh_interval, refresh_min_tokens=refresh_min_tokens
    )
    loaded = load_model(model, device=device, dtype=dtype)
    check_batchable(loaded.model)
    fingerprint = load_tokenizer(resolve_model_spec(model)).fingerprint
    cost = None
    if max_draft_tokens is None:
        cost = calibrate(loaded.model, on_progress=lambda line: typer.echo(line, err=True))
    scheduler = Scheduler(
        loaded.model, loaded.tokenizer, max_batch=max_batch, max_queue=max_queue, max_draft_tokens=max_draft_tokens,
        cost=cost,
    )  # fmt: skip
    engine = Engine(
        scheduler, loaded.tokenizer, model_name=model, store=store, drafter=drafter, dsn=dsn, fingerprint=fingerprint,
        read_dsn=read_dsn, learning=learning,
    )  # fmt: skip
    if store:
        engine.store(store)  # a missing store or another tokenizer's fails now; a database that is down does not
    app = create_app(engine, api_key=api_key)
    typer.echo(f"serving {model} on http://{host}:{port}/v1 (max batch {max_batch})", err=True)
    run_app(app, host=host, port=port)


def run_app(app: Any, *, host: str, port: int, log_level: str = "info") -> None:
    """Run `app` under uvicorn until SIGTERM (return once drained) or Ctrl-C (raise KeyboardInterrupt once drained).

    uvicorn drains on either signal, restores the handlers it found and then raises the signal again; the
    handlers installed here only note it, so the process exits 0 after a SIGTERM and 130 after Ctrl-C.
    """
    import signal

    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=600)
    server = uvicorn.Server(config)
    noted: list[int] = []

    def note(sig: int, _frame: Any) -> None:
        noted.append(sig)
        server.should_exit = True  # a signal before uvicorn's own handlers are in place stops it too

    before = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if signal.SIGINT in noted:
        raise KeyboardInterrupt
