"""`crest bench serve`: a running crest server driven by the `openai` client from many threads, per drafter.

For each drafter (the request's `drafter` field) and concurrency level, `drive` sends every request as a
greedy stream from that many threads at once and measures output tokens/s and requests/s over the level's
wall time, time to first token (the first chunk with text), inter-token latency per request ((last chunk -
first chunk) / (tokens - 1), as vLLM's TPOT), the gaps between streamed chunks (a chunk carries all the
tokens one step accepted), the mean accepted length (completion tokens per target forward, from the usage's
`crest.forward_passes`) and errors. `bench_baseline` runs the same prompts through the library generator one
by one (as `crest generate` does): the batch-1 baseline. When no URL is given, `crest serve` is started on a
free port (`crest.bench.server_process`). The driver is `crest.bench.serve_driver`, the figures
`crest.bench.serve_figures`, the targets and the plot `crest.bench.serve_report`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from crest.bench.serve_driver import accepted_draft_tokens, drive, run_levels
from crest.bench.serve_figures import ServeFigures, Timed, compare_to_none, serve_figures
from crest.bench.server_process import ServerProcess
from crest.errors import ConfigError

__all__ = [
    "ServeFigures",
    "ServeRun",
    "accepted_draft_tokens",
    "bench_baseline",
    "check_levels",
    "compare_to_none",
    "drive",
    "run_levels",
    "run_serve_bench",
]


def bench_baseline(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    drafters: dict[str, Any],
    *,
    max_tokens: int = 128,
    cost: Any = None,
    max_draft_tokens: int | None = None,
) -> list[tuple[ServeFigures, list[str | None]]]:
    """Run the prompt ids through the library generator one by one per drafter (the batch-1 baseline)."""
    from crest.decoding.generator import SpeculativeGenerator

    rows = []
    for name, drafter in drafters.items():
        gen = SpeculativeGenerator(model, tokenizer, max_draft_tokens=max_draft_tokens, cost=cost)
        gen.generate(prompts[0][:64], drafter=drafter, max_new_tokens=4)  # warm up
        done: list[Timed] = []
        wall = 0.0
        for ids in prompts:
            chunks: list[float] = []
            started = time.perf_counter()
            result = gen.generate(ids, drafter=drafter, max_new_tokens=max_tokens, on_text=_clock(chunks))
            wall += time.perf_counter() - started
            done.append(Timed(result.text, result.new_tokens, result.forward_passes, started, chunks))
        texts: list[str | None] = [d.text for d in done]
        rows.append((serve_figures(done, mode="batch-1", drafter=name, concurrency=1, wall=wall), texts))
    return rows


def _clock(chunks: list[float]) -> Callable[[str], None]:
    """Return an `on_text` callback noting when each piece of text arrives."""
    return lambda _: chunks.append(time.perf_counter())


@dataclass
class ServeRun:
    """A whole `crest bench serve` run: its rows, each row's texts and the started server's exit code."""

    rows: list[ServeFigures]
    server_exit_code: int | None  # None: given a URL
    texts: dict[tuple[str, str, int], list[str | None]]  # (mode, drafter, concurrency) -> one text per prompt


def run_serve_bench(
    prompts: Sequence[str],
    *,
    url: str | None,
    drafters: Sequence[str],
    levels: Sequence[int],
    max_tokens: int = 128,
    chat: bool = False,
    model: str = "smollm2",
    store: str | None = None,
    max_batch: int = 16,
    max_draft_tokens: int | None = None,
    baseline: bool = True,
    api_key: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    dsn: str | None = None,
    label: str | None = None,
    note: Callable[[str], None] = lambda _: None,
) -> ServeRun:
    """Run the batch-1 baseline (before any server is started), then every drafter and level against the server."""
    import importlib.util

    if importlib.util.find_spec("openai") is None:
        raise ConfigError("crest bench serve drives the server with the openai package: pip install openai")
    rows: list[ServeFigures] = []
    texts: dict[tuple[str, str, int], list[str | None]] = {}
    if baseline:
        rows += _baseline(
            prompts,
            drafters,
            model=model,
            store=store,
            chat=chat,
            max_tokens=max_tokens,
            max_draft_tokens=max_draft_tokens,
            device=device,
            dtype=dtype,
            dsn=dsn,
            texts=texts,
            note=note,
        )
    options: dict[str, Any] = dict(
        max_tokens=max_tokens, chat=chat, store=store, api_key=api_key or "none", model=model, label=label
    )
    exit_code = None
    if url is not None:
        found, done = run_levels(url, prompts, drafters=drafters, levels=levels, note=note, **options)
    else:
        args = ["--model", model, "--device", device, "--dtype", dtype, "--max-batch", str(max_batch)]
        args += ["--store", store, "--drafter", "crest+prompt"] if store else ["--drafter", "prompt"]
        args += ["--no-learn", "--refresh-interval", "0"]
        args += ["--max-draft-tokens", str(max_draft_tokens)] if max_draft_tokens is not None else []
        args += ["--dsn", dsn] if dsn else []
        args += ["--api-key", api_key] if api_key else []
        note(f"starting crest serve {' '.join(args)}")
        with ServerProcess(args) as server:
            found, done = run_levels(server.url, prompts, drafters=drafters, levels=levels, note=note, **options)
        exit_code = server.exit_code
    rows += found
    texts |= done
    compare_to_none(rows, texts)
    return ServeRun(rows, exit_code, texts)


def _baseline(
    prompts: Sequence[str],
    drafters: Sequence[str],
    *,
    model: str,
    store: str | None,
    chat: bool,
    max_tokens: int,
    max_draft_tokens: int | None,
    device: str,
    dtype: str,
    dsn: str | None,
    texts: dict[tuple[str, str, int], list[str | None]],
    note: Callable[[str], None],
) -> list[ServeFigures]:
    """Load the model here, run the batch-1 baseline per drafter, and free the model before the server starts."""
    import gc

    from crest.decoding.models import load_model
    from crest.decoding.sizing import calibrate
    from crest.decoding.tokenizer import Tokenizer
    from crest.drafters.registry import close_drafter, open_drafter

    loaded = load_model(model, device=device, dtype=dtype)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint  # the model's tokenizer, not loaded again
    sources = {name: open_drafter(name, store=store, dsn=dsn, fingerprint=fingerprint) for name in drafters}
    cost = calibrate(loaded.model, on_progress=note) if max_draft_tokens is None else None
    ids = [loaded.encode_prompt(text, chat=chat) for text in prompts]
    found = bench_baseline(
        loaded.model,
        loaded.tokenizer,
        ids,
        sources,
        max_tokens=max_tokens,
        cost=cost,
        max_draft_tokens=max_draft_tokens,
    )
    rows = []
    for row, done in found:
        note(f"batch-1 {row.drafter}: {row.output_tokens_per_second:.1f} tokens/s, M = {row.mean_accepted_length:.2f}")
        rows.append(row)
        texts["batch-1", row.drafter, 1] = done
    for source in sources.values():
        close_drafter(source)
    del loaded
    gc.collect()
    return rows


def check_levels(text: str) -> list[int]:
    """Return the concurrency levels of a comma-separated list, or raise ConfigError."""
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r} is not a comma-separated list of integers") from None
    if not levels or any(v < 1 for v in levels):
        raise ConfigError("--concurrency needs positive integers, e.g. 1,4,16")
    return sorted(set(levels))
