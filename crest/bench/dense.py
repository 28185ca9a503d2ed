"""Dense drafting measured by replay: M of the dense drafters beside crest's on known greedy continuations.

For each prompt the target decodes greedily once (the reference), then runs one plain forward over prompt and
reference for the last hidden state at every position; each drafter is then replayed on the reference
(`crest.bench.replay`) with the same node budget, the dense parts fed the hidden state that predicted each
context's last token, exactly what the generator hands them after a verify forward (up to the tree mask's
rounding). One drafter per name serves all prompts, as a server's would. The batched lookup latency is timed
on the same hidden states: `batch` contexts per statement. Run: `python3 -m crest.bench.dense --store S`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft

from crest.bench.generate import generate_plain
from crest.bench.prompts import load_prompts
from crest.bench.replay import replay
from crest.decoding.drafter import Drafter
from crest.decoding.hidden import feed_hidden, final_hidden, wants_hidden
from crest.drafters.registry import close_drafter, open_drafter

DRAFTERS = ("crest", "crest+prompt", "dense", "crest+dense", "crest+dense+prompt")


class HiddenReplay:
    """Hands a drafter the known hidden state for each context before it drafts (positions of one sequence)."""

    def __init__(self, drafter: Drafter, hidden: np.ndarray) -> None:
        self.drafter, self.hidden = drafter, hidden  # hidden: [N, H], row i predicted token i + 1

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Feed the state that predicted the context's last token, then draft."""
        n = len(context_ids)
        feed_hidden(self.drafter, n, self.hidden[n - 2] if n >= 2 else None)
        return self.drafter.draft(context_ids, max_nodes)


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
        ids = torch.tensor([prompt + out], device=loaded.device)
        hidden = final_hidden(loaded.model, ids)[0].float().cpu().numpy()  # [N, H]
        states.append(hidden[len(prompt) - 1 :])
        for name, drafter in opened.items():
            run = replay(HiddenReplay(drafter, hidden), prompt, out, max_nodes=max_nodes, max_new_tokens=max_new_tokens)
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
            "batch": batch,
            "p50": round(1000 * float(np.percentile(times, 50)), 2),
            "p95": round(1000 * float(np.percentile(times, 95)), 2),
        }
    return figures


def main() -> None:
    """Parse the options and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    args = parser.parse_args()
    figures = compare(
        args.model,
        store=args.store,
        dsn=args.dsn,
        prompts=args.prompts,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        max_nodes=args.max_nodes,
        drafters=args.drafters.split(","),
    )
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
