"""The composition root of `crest serve`: check the options, load and calibrate the model, build and run the app.

`build_app` checks everything that can be checked before the model loads (the drafter, where it runs, the
store: a mistyped one costs no model load; a database that is down only costs store drafts until it answers),
loads the model once, checks it can be batched, measures (or loads) the forward cost model, and builds the
scheduler, the engine and the FastAPI app. `run_app` runs an app under uvicorn, which drains in-flight requests
on SIGTERM or Ctrl-C before the scheduler stops: a drained SIGTERM returns, Ctrl-C raises KeyboardInterrupt.
The CLI only parses options into `ServeOptions` and calls `serve`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from crest.config import DEFAULT_DRAFTER
from crest.drafters.registry import check_drafter, kind_of
from crest.drafters.store import check_store
from crest.drafting.hub import LearnOptions
from crest.errors import ConfigError


@dataclass(frozen=True)
class ServeOptions:
    """What `crest serve` runs: the model, the default store and drafter, the address, batching and learning."""

    model: str = "smollm2"
    store: str | None = None
    drafter: str = DEFAULT_DRAFTER
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    max_draft_tokens: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    api_key: str | None = None
    dsn: str | None = None
    read_dsn: str | None = None
    learning: LearnOptions = field(default_factory=LearnOptions)

    def checked(self) -> ServeOptions:
        """Return the options with the drafter's canonical name, or raise ConfigError naming the first bad one."""
        if self.max_batch < 1 or self.max_queue < 0 or not 0 < self.port < 65536:
            raise ConfigError("--max-batch must be >= 1, --max-queue >= 0 and --port in 1..65535")
        learning = self.learning
        if learning.window < 1 or not 0 <= learning.refresh_interval < math.inf or learning.refresh_min_tokens < 0:
            raise ConfigError("--learn-window must be >= 1, --refresh-interval >= 0 and --refresh-min-tokens >= 0")
        if learning.dense_window < 0:
            raise ConfigError(f"--learn-dense-window must be >= 0, got {learning.dense_window}")
        return replace(self, drafter=check_drafter(self.drafter, where="serve", store=self.store))


def build_app(options: ServeOptions, *, on_progress: Callable[[str], None] | None = None) -> Any:
    """Return the FastAPI app serving `options` (its engine started on the first request's lifespan)."""
    from crest.decoding.models import load_model
    from crest.decoding.sizing import calibrate
    from crest.decoding.tokenizer import Tokenizer
    from crest.serving.app import create_app
    from crest.serving.batch import check_batchable
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler

    opts = options.checked()
    if opts.store:
        check_store(opts.store, dsn=opts.read_dsn or opts.dsn)  # before the model loads
    loaded = load_model(opts.model, device=opts.device, dtype=opts.dtype)
    check_batchable(loaded.model)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint  # the model's tokenizer, not loaded again
    cost = calibrate(loaded.model, on_progress=on_progress) if opts.max_draft_tokens is None else None
    scheduler = Scheduler(
        loaded.model, loaded.tokenizer, max_batch=opts.max_batch, max_queue=opts.max_queue,
        max_draft_tokens=opts.max_draft_tokens, cost=cost,
    )  # fmt: skip
    engine = Engine(
        scheduler, loaded.tokenizer, model_name=opts.model, store=opts.store, drafter=opts.drafter, dsn=opts.dsn,
        fingerprint=fingerprint, read_dsn=opts.read_dsn, learning=opts.learning,
    )  # fmt: skip
    if opts.store:
        engine.store(opts.store)  # a missing store or another tokenizer's fails now; a database that is down does not
        if "dense_index" in kind_of(opts.drafter).needs:
            engine.dense_index(opts.store)  # no dense part, or one of another model, fails now too
    return create_app(engine, api_key=opts.api_key)


def serve(options: ServeOptions, *, on_progress: Callable[[str], None] | None = None) -> None:
    """Build the app for `options` and serve it until SIGTERM (return) or Ctrl-C (KeyboardInterrupt), drained."""
    check_listen(options.checked().host, options.port)  # before the model loads, not after
    app = build_app(options, on_progress=on_progress)
    if on_progress is not None:
        on_progress(
            f"serving {options.model} on http://{options.host}:{options.port}/v1 (max batch {options.max_batch})"
        )
    run_app(app, host=options.host, port=options.port)


def check_listen(host: str, port: int) -> None:
    """Raise ConfigError unless `host:port` can be listened on now (bound as uvicorn binds it, then let go)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # uvicorn's choice: "localhost" is tried as IPv4
    try:
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (OSError, TypeError) as exc:  # gaierror: a name that does not resolve; TypeError: one not encodable
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise ConfigError(f"cannot listen on {where}: {getattr(exc, 'strerror', None) or exc}") from None


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
