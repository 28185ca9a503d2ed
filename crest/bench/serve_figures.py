"""The figures of `crest bench serve`: one drafter at one concurrency, from the chunk times of its requests.

Output tokens/s and requests/s over the level's wall time, time to first token (the first chunk with text),
inter-token latency per request ((last chunk - first chunk) / (tokens - 1), as vLLM's TPOT), the gaps between
streamed chunks (a chunk carries all the tokens one step accepted), the mean accepted length (completion tokens
per target forward) and, against the `none` drafter's row, the speedup and how many texts are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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
class Timed:
    """One finished request: its text, token and forward counts, and when each chunk arrived."""

    text: str
    tokens: int
    forwards: int
    started: float
    chunks: list[float]


def _pcts(values: Sequence[float], *, scale: float = 1e3) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    found = np.asarray(values, dtype=np.float64) * scale
    return float(np.percentile(found, 50)), float(np.percentile(found, 99))


def serve_figures(done: Sequence[Timed], *, mode: str, drafter: str, concurrency: int, wall: float) -> ServeFigures:
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
