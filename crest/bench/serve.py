"""`crest bench serve`: a running crest server driven by the `openai` client from many threads, per drafter.

For each drafter (the request's `drafter` field) and concurrency level, `drive` sends every request as a
greedy stream from that many threads at once and measures output tokens/s and requests/s over the level's
wall time, time to first token (the first chunk with text), inter-token latency per request ((last chunk -
first chunk) / (tokens - 1), as vLLM's TPOT), the gaps between streamed chunks (a chunk carries all the
tokens one step accepted), the mean accepted length (completion tokens per target forward, from the usage's
`crest.forward_passes`) and errors. `bench_baseline` runs the same prompts through the library generator one
by one (as `crest generate` does): the batch-1 baseline. When no URL is given, `crest serve` is started on a
free port (`crest.bench.server_process`). The targets and the plot are in `crest.bench.serve_report`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from crest.bench.server_process import ServerProcess
from crest.errors import ConfigError, CrestError


@dataclass
class ServeFigures:
    """One drafter at one concurrency: throughput, latency percentiles, accepted length, errors."""

    mode: str  # server: through the HTTP server; batch-1: the library generator, one prompt at a time
    drafter: str
    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    seconds: float
    output_tokens_per_second: float
    requests_per_second: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    chunk_gap_ms_p50: float
    chunk_gap_ms_p99: float
    mean_accepted_length: float
    speedup_vs_none: float | None = None  # tokens/s over `none`'s, same mode and concurrency
    same_text_as_none: int | None = None  # requests whose text equals `none`'s for the same prompt


@dataclass
class _Timed:
    """One finished request: its text, token and forward counts, and when each chunk arrived."""

    text: str
    tokens: int
    forwards: int
    started: float
    chunks: list[float]


def drive(
    url: str,
    prompts: Sequence[str],
    *,
    drafter: str,
    concurrency: int,
    max_tokens: int = 128,
    chat: bool = False,
    store: str | None = None,
    api_key: str = "none",
    model: str = "crest",
    label: str | None = None,
) -> tuple[ServeFigures, list[str | None]]:
    """Send every prompt as a greedy stream from `concurrency` threads; return the figures and each text.

    `label` names the rows instead of `drafter` (a server that drafts its own way, as vLLM with its proposer).
    """
    import openai

    # one client for every thread: its httpx connection pool is thread-safe
    client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=600.0)
    # learning off: a later drafter must not draft from what an earlier one served for the same prompts
    extra: dict[str, Any] = {"drafter": drafter, "learn": False} | ({"store": store} if store else {})
    errors: list[str] = []

    def one(prompt: str) -> _Timed | None:
        try:
            return _stream(client, prompt, model=model, chat=chat, max_tokens=max_tokens, extra=extra)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return None

    try:  # warm up this drafter's path (the store's statements, the prompt drafter)
        model = next((card.id for card in client.models.list().data), model)  # the served model: others are a 404
        _stream(client, prompts[0], model=model, chat=chat, max_tokens=4, extra=extra)
    except Exception as exc:
        raise CrestError(f"the server at {url} did not answer a first request: {exc}") from None
    before = accepted_draft_tokens(url)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - started
    finished = [d for d in done if d is not None]
    after = accepted_draft_tokens(url)
    if before is not None and after is not None and not any(d.forwards for d in finished):
        # a server that reports no forwards per request (vLLM): each target forward of a request emits one
        # token beyond the draft tokens it accepted, so its forwards are its tokens less those accepted
        accepted = (after - before) / max(1, sum(d.tokens for d in finished))
        for d in finished:
            d.forwards = max(1, round(d.tokens * (1.0 - accepted)))
    figures = _figures(finished, mode="server", drafter=label or drafter, concurrency=concurrency, wall=wall)
    figures.requests, figures.errors = len(prompts), len(errors)
    if errors:
        print(f"bench serve: {drafter} at {concurrency}: {len(errors)} error(s), first: {errors[0]}", file=sys.stderr)
    return figures, [d.text if d is not None else None for d in done]


def _stream(client: Any, prompt: str, *, model: str, chat: bool, max_tokens: int, extra: dict[str, Any]) -> _Timed:
    """Send one streamed greedy request and time its chunks."""
    common: dict[str, Any] = dict(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    started = time.perf_counter()
    if chat:
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], extra_body=extra, **common
        )
    else:
        stream = client.completions.create(prompt=prompt, extra_body=extra, **common)
    pieces: list[str] = []
    chunks: list[float] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = (choice.delta.content if chat else choice.text) or ""
        if piece:
            chunks.append(time.perf_counter())
            pieces.append(piece)
    if usage is None:
        raise CrestError("the stream ended without a usage chunk")
    forwards = int(((usage.model_extra or {}).get("crest") or {}).get("forward_passes") or 0)
    return _Timed("".join(pieces), int(usage.completion_tokens), forwards, started, chunks)


def accepted_draft_tokens(url: str) -> float | None:
    """Return the draft tokens a vLLM or llama.cpp server accepted so far (its /metrics counter), or None."""
    import httpx

    try:
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(
            ("vllm:spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total")
        )
    ]
    if values:
        return sum(values)
    return 0.0 if "vllm:" in text else None  # a vLLM without speculation: nothing accepted, one token a forward


def _pcts(values: Sequence[float], *, scale: float = 1e3) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    found = np.asarray(values, dtype=np.float64) * scale
    return float(np.percentile(found, 50)), float(np.percentile(found, 99))


def _figures(done: Sequence[_Timed], *, mode: str, drafter: str, concurrency: int, wall: float) -> ServeFigures:
    """Return the figures of finished requests that took `wall` seconds in all."""
    tokens = sum(d.tokens for d in done)
    ttft = [d.chunks[0] - d.started for d in done if d.chunks]
    itl = [(d.chunks[-1] - d.chunks[0]) / (d.tokens - 1) for d in done if d.chunks and d.tokens > 1]
    gaps = [b - a for d in done for a, b in zip(d.chunks, d.chunks[1:], strict=False)]
    forwards = sum(d.forwards for d in done)
    return ServeFigures(
        mode=mode,
        drafter=drafter,
        concurrency=concurrency,
        requests=len(done),
        errors=0,
        output_tokens=tokens,
        seconds=wall,
        output_tokens_per_second=tokens / wall if wall > 0 else 0.0,
        requests_per_second=len(done) / wall if wall > 0 else 0.0,
        ttft_ms_p50=_pcts(ttft)[0],
        ttft_ms_p99=_pcts(ttft)[1],
        itl_ms_p50=_pcts(itl)[0],
        itl_ms_p99=_pcts(itl)[1],
        chunk_gap_ms_p50=_pcts(gaps)[0],
        chunk_gap_ms_p99=_pcts(gaps)[1],
        mean_accepted_length=tokens / forwards if forwards else 0.0,
    )


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
        done: list[_Timed] = []
        wall = 0.0
        for ids in prompts:
            chunks: list[float] = []
            started = time.perf_counter()
            result = gen.generate(ids, drafter=drafter, max_new_tokens=max_tokens, on_text=_clock(chunks))
            wall += time.perf_counter() - started
            done.append(_Timed(result.text, result.new_tokens, result.forward_passes, started, chunks))
        texts: list[str | None] = [d.text for d in done]
        rows.append((_figures(done, mode="batch-1", drafter=name, concurrency=1, wall=wall), texts))
    return rows


def _clock(chunks: list[float]) -> Callable[[str], None]:
    """Return an `on_text` callback noting when each piece of text arrives."""
    return lambda _: chunks.append(time.perf_counter())


def compare_to_none(rows: list[ServeFigures], texts: dict[tuple[str, str, int], list[str | None]]) -> None:
    """Fill each row's speedup over `none` (same mode and concurrency) and its texts equal to `none`'s."""
    base = {(r.mode, r.concurrency): r for r in rows if r.drafter == "none"}
    for row in rows:
        none = base.get((row.mode, row.concurrency))
        if none is None:
            continue
        if none.output_tokens_per_second > 0:
            row.speedup_vs_none = row.output_tokens_per_second / none.output_tokens_per_second
        mine, ref = texts.get((row.mode, row.drafter, row.concurrency)), texts.get((row.mode, "none", row.concurrency))
        if mine is not None and ref is not None:
            row.same_text_as_none = sum(a is not None and a == b for a, b in zip(mine, ref, strict=True))


def run_levels(
    url: str,
    prompts: Sequence[str],
    *,
    drafters: Sequence[str],
    levels: Sequence[int],
    note: Callable[[str], None] = lambda _: None,
    **options: Any,
) -> tuple[list[ServeFigures], dict[tuple[str, str, int], list[str | None]]]:
    """Drive every drafter at every concurrency level; return the rows and each level's texts."""
    rows, texts = [], {}
    for name in drafters:
        for level in levels:
            figures, done = drive(url, prompts, drafter=name, concurrency=level, **options)
            note(
                f"{name} at concurrency {level}: {figures.output_tokens_per_second:.1f} tokens/s, "
                f"M = {figures.mean_accepted_length:.2f}, {figures.errors} error(s)"
            )
            rows.append(figures)
            texts["server", figures.drafter, level] = done  # keyed as the row is named (--label)
    return rows, texts


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
