"""Driving a running server with the `openai` client from many threads: one drafter at each concurrency level.

For each drafter (the request's `drafter` field) and concurrency level, `drive` sends every request as a greedy
stream from that many threads at once and times its chunks; the mean accepted length comes from the usage's
`crest.forward_passes`, or, for a server that reports none (vLLM, llama.cpp), from its /metrics counter of
accepted draft tokens.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crest.bench.serve_figures import ServeFigures, Timed, serve_figures
from crest.errors import CrestError


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
    extra: dict[str, Any] = {"drafter": drafter, "learn": False} | ({"crest_store": store} if store else {})
    errors: list[str] = []

    def one(prompt: str) -> Timed | None:
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
    figures = serve_figures(finished, mode="server", drafter=label or drafter, concurrency=concurrency, wall=wall)
    figures.requests, figures.errors = len(prompts), len(errors)
    if errors:
        print(f"bench serve: {drafter} at {concurrency}: {len(errors)} error(s), first: {errors[0]}", file=sys.stderr)
    return figures, [d.text if d is not None else None for d in done]


def _stream(client: Any, prompt: str, *, model: str, chat: bool, max_tokens: int, extra: dict[str, Any]) -> Timed:
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
    return Timed("".join(pieces), int(usage.completion_tokens), forwards, started, chunks)


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
