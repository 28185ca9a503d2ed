"""The ablations of `crest bench accept` (the CREST paper's Figures 8-9 and Table 2): single-n and n <= m stores.

For each n up to `max_n` and each ablation top-t it builds (or reuses) a store keeping the top t n-grams of that n
only ("single"), and one keeping those of each n up to it ("upto"), and replays the crest drafter over the first
`ablation_limit` prompts' greedy continuations; the average tree sizes of the single-n stores at the largest top-t
are the paper's Table 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from crest.bench.accept_options import AcceptOptions
from crest.bench.datastores import Corpus, build_store
from crest.bench.replay import replay
from crest.config import IngestOptions
from crest.drafters.registry import make_drafter


def ablate(
    opts: AcceptOptions,
    corpus: Corpus,
    *,
    model: str,
    dsn: str,
    fingerprint: str,
    out: Path,
    setting: str,
    prompt_ids: list[list[int]],
    references: list[list[int]],
    max_positions: int,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Measure M (replay, crest drafter) for single-n and n <= m stores at each ablation top-t; tree sizes."""
    from crest_client import Store

    tops = opts.ablation_top_t or opts.top_t
    count = min(opts.ablation_limit, len(prompt_ids))
    curves: dict[str, list[dict[str, Any]]] = {"single": [], "upto": []}
    for mode in ("single", "upto"):
        for n in range(1, opts.max_n + 1):
            for t in tops:
                options = IngestOptions(max_n=n, top_t=t, selection=mode, single_n=n, seed=opts.seed)
                name = f"acc_{setting}_{'n' if mode == 'single' else 'm'}{n}_t{t}"
                variant = build_store(
                    corpus, name=name, tokenizer=model, dsn=dsn, options=options, out=out, rebuild=opts.rebuild
                )
                note(f"ablation store {name}: {variant.rows:,} n-grams, {variant.nbytes:,} bytes")
                tokens = steps = 0
                with Store.connect(dsn, name, tokenizer_fingerprint=fingerprint, timeout=1.0, pool_size=1) as store:
                    for ids, ref in zip(prompt_ids[:count], references[:count], strict=True):
                        r = replay(
                            make_drafter("crest", store=store),
                            ids,
                            ref,
                            max_nodes=opts.max_nodes,
                            max_new_tokens=opts.max_new_tokens,
                            max_positions=max_positions,
                        )
                        tokens, steps = tokens + r.new_tokens, steps + r.steps
                curves[mode].append(
                    {
                        "n": n,
                        "top_t": t,
                        "store": name,
                        "ngrams": variant.rows,
                        "bytes": variant.nbytes,
                        "avg_tree_nodes": variant.avg_tree_nodes,
                        "mean_accepted_length": tokens / max(1, steps),
                        "prompts": count,
                    }
                )
    top = max(tops)
    trees = [
        {"n": c["n"], "ngrams": c["ngrams"], "avg_tree_nodes": c["avg_tree_nodes"]}
        for c in curves["single"]
        if c["top_t"] == top
    ]
    return {**curves, "tree_sizes": trees, "prompts": count, "method": "replay"}
