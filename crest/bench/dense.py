"""Dense drafting measured by replay: M of the dense drafters beside crest's on known greedy continuations.

For each prompt the target decodes greedily once (the reference); each drafter is then replayed on it
(`crest.bench.replay`, which feeds the dense parts the hidden state that predicted each context's last token, from
one plain forward over prompt and reference) with the same node budget. One drafter per name serves all prompts,
as a server's would. The batched lookup latency is timed on the same hidden states: `batch` contexts per
statement, beside the load average. Run: `crest bench dense --store S`; with `--indexes
ivfflat,hnsw` it measures the lookup only: each candidate index built on a copy of the store's dense part, side
by side, the batch's latency and recall@k against exact search (`crest.bench.dense_lookup`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from crest.bench.generate import generate_plain
from crest.bench.replay import reference_hidden, replay
from crest.decoding.drafter import Drafter
from crest.decoding.hidden import wants_hidden
from crest.drafters.registry import close_drafter, open_drafter
from crest.ingest.prompts import load_prompts

DRAFTERS = ("crest", "crest+prompt", "dense", "crest+dense", "crest+dense+prompt")


def compare(
    model_spec: str,
    *,
    store: str,
    dsn: str | None = None,
    prompts: str = "humaneval",
    limit: int = 20,
    max_new_tokens: int = 128,
    max_nodes: int = 64,
    drafters: Sequence[str] = DRAFTERS,
    batch: int = 16,
) -> dict[str, Any]:
    """Return each drafter's replayed M on the prompts' greedy continuations, and the batched dense lookup time."""
    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import load_tokenizer

    loaded = load_model(model_spec)
    fingerprint = load_tokenizer(model_spec).fingerprint
    opened = {  # a patient connect: a database slow to answer at the start would cost the first drafts
        name: open_drafter(name, store=store, dsn=dsn, fingerprint=fingerprint, connect_timeout=10.0)
        for name in drafters
    }
    try:
        sizes = {"limit": limit, "max_new_tokens": max_new_tokens, "max_nodes": max_nodes, "batch": batch}
        return _measure(opened, loaded, prompts=prompts, **sizes)
    finally:
        for drafter in opened.values():
            close_drafter(drafter)


def _measure(
    opened: dict[str, Drafter],
    loaded: Any,
    *,
    prompts: str,
    limit: int,
    max_new_tokens: int,
    max_nodes: int,
    batch: int,
) -> dict[str, Any]:
    for drafter in opened.values():
        if wants_hidden(drafter):
            drafter.bind_model(loaded.model)  # type: ignore[attr-defined]
    totals = {name: [0, 0] for name in opened}  # new tokens, steps
    states: list[np.ndarray] = []
    for text in load_prompts(prompts, limit=limit):
        prompt = list(loaded.tokenizer(text)["input_ids"])
        out = generate_plain(loaded.model, loaded.tokenizer, prompt, max_new_tokens=max_new_tokens).output_token_ids
        hidden = reference_hidden(loaded.model, prompt, out)  # [N, H]
        states.append(hidden[len(prompt) - 1 :])
        for name, drafter in opened.items():
            run = replay(drafter, prompt, out, max_nodes=max_nodes, max_new_tokens=max_new_tokens, hidden=hidden)
            totals[name][0] += run.new_tokens
            totals[name][1] += run.steps
    figures: dict[str, Any] = {
        "M": {name: round(new / max(1, steps), 3) for name, (new, steps) in totals.items()},
        "prompts": limit,
        "max_new_tokens": max_new_tokens,
        "max_nodes": max_nodes,
    }
    index = next((getattr(d, "index", None) for d in opened.values() if getattr(d, "index", None) is not None), None)
    if index is not None and states:
        pool = np.concatenate(states)  # [P, H]
        rng = np.random.default_rng(0)
        times = []
        for _ in range(200):
            rows = pool[rng.integers(0, pool.shape[0], batch)]
            t0 = time.perf_counter()
            index.search(rows, k=16)
            times.append(time.perf_counter() - t0)
        figures["lookup_ms"] = {
            "index": index.meta.index.record() if index.meta is not None else None,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "batch": batch,
            "p50": round(1000 * float(np.percentile(times, 50)), 2),
            "p95": round(1000 * float(np.percentile(times, 95)), 2),
        }
    return figures
