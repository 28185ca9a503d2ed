"""The measuring loop of `crest bench accept`: every prompt decoded plainly once, every drafter and size replayed on it.

For each prompt the plain greedy continuation (decoded now, or read from a previous run's `references.json` when
`timing` is none) is the reference; each (drafter, datastore) row is replayed on it with the verifier's tree cut
(`crest.bench.replay`), the dense rows fed the hidden states of one plain forward over prompt and reference; the
first `check` prompts also run the real loop with fixed-size trees for each drafter's largest datastore (the
cross-check), and the rows `timing` asks for run real generation with the adaptive draft size, interleaved with
the plain baseline, for tokens/s. One row per (drafter, datastore) with M, draft latency and the real figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crest.bench import accept_dense
from crest.bench.accept_options import DENSE_DRAFTERS, AcceptOptions
from crest.bench.datastores import Variant
from crest.bench.references import REFERENCES, Reference, known_references, record_references, reference_key
from crest.bench.replay import reference_hidden, replay
from crest.decoding.drafter import Drafter, NoneDrafter
from crest.decoding.hidden import bind_drafter
from crest.decoding.sizing import calibrate
from crest.drafters.registry import make_drafter


def _generator(model: Any, tokenizer: Any, *, max_draft_tokens: int | None, cost: Any) -> Any:
    """Return a fresh generator (its own acceptance estimate) sharing the calibrated cost model."""
    from crest.decoding.generator import SpeculativeGenerator

    # the cost model is calibrated once per model; each drafter keeps its own acceptance statistics
    return SpeculativeGenerator(model, tokenizer, max_draft_tokens=max_draft_tokens, cost=cost)


def _drafter(name: str, variant: Variant | None, *, parts: dict[str, dict[str, Any]]) -> Drafter:
    """Return the registry's drafter `name` on the store, REST index or dense part of `variant`."""
    key = variant.name if variant else ""
    return make_drafter(
        name,
        store=parts["stores"].get(variant.store or key if variant else key),
        rest_index=parts["indexes"].get(key),
        dense_index=parts["dense"].get(variant.dense_store if variant else ""),
    )


def _sizes(name: str, variants: dict[str, Sequence[Variant]]) -> Sequence[Variant | None]:
    """Return the datastores drafter `name` runs on (one row each; [None] for a drafter without one)."""
    if name == "rest":
        return variants["rest"]
    if name == "dense":
        return variants["dense"]
    if name in DENSE_DRAFTERS:
        return variants["hybrid"]
    return variants["crest"] if name.startswith("crest") else [None]


def _pct_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values or [0.0]), q)) * 1e3


def measure(
    opts: AcceptOptions,
    *,
    loaded: Any,
    prompt_ids: list[list[int]],
    rest: Sequence[Variant],
    crest: Sequence[Variant],
    dsn: str,
    fingerprint: str,
    out: Path,
    note: Callable[[str], None] = lambda line: None,
    dense: Sequence[Variant] = (),
    hybrid: Sequence[Variant] = (),
) -> dict[str, Any]:
    """Generate every prompt plainly, replay every drafter and size on it, time the sizes `timing` asks for."""
    from crest_client import Store

    from crest.drafters.suffix_array import RestIndex

    started = time.perf_counter()

    model, tokenizer = loaded.model, loaded.tokenizer
    base = _generator(model, tokenizer, max_draft_tokens=0, cost=None)  # plain decoding, no calibration needed
    max_positions = base.max_positions
    indexes = {v.name: RestIndex.load(out / v.name) for v in rest}
    stores = {
        v.name: Store.connect(dsn, v.name, tokenizer_fingerprint=fingerprint, timeout=1.0, pool_size=1) for v in crest
    }
    timing_stores = {
        v.name: Store.connect(dsn, v.name, tokenizer_fingerprint=fingerprint, timeout=1.0, pool_size=1) for v in crest
    }
    dense_parts = accept_dense.open_indexes(dense, dsn=dsn, fingerprint=fingerprint)  # replay and timing alike
    parts: dict[str, dict[str, Any]] = {"stores": stores, "indexes": indexes, "dense": dense_parts}
    timing_parts = {**parts, "stores": timing_stores}
    variants = {"rest": rest, "crest": crest, "dense": dense, "hybrid": hybrid}
    keys: list[tuple[str, Variant | None]] = [(name, v) for name in opts.drafters for v in _sizes(name, variants)]
    fed = any(name in DENSE_DRAFTERS for name, _ in keys)  # a forward per prompt for the hidden states
    largest = {
        d: max((v for n, v in keys if n == d and v), key=lambda v: v.nbytes, default=None) for d in opts.drafters
    }
    timed = [k for k in keys if k[0] != "none" and opts.timing != "none"]
    timed = [k for k in timed if opts.timing == "all" or k[1] is largest[k[0]]]
    adaptive = opts.max_draft_tokens is None
    fresh = {"tokens": 0, "steps": 0, "draft": [], "real_tokens": 0, "real_seconds": 0.0, "real_steps": 0, "exact": 0}
    acc: dict[str, dict[str, Any]] = {_key(k): {**fresh, "draft": []} for k in keys}
    base_tokens, base_seconds, checks = 0, 0.0, []
    cost = calibrate(model, on_progress=note) if timed and adaptive else None
    gens = {_key(k): _generator(model, tokenizer, max_draft_tokens=opts.max_draft_tokens, cost=cost) for k in timed}
    fixed = _generator(model, tokenizer, max_draft_tokens=opts.max_nodes, cost=None)
    references: list[list[int]] = []
    key = reference_key(loaded, prompt_ids, opts)
    known = known_references(out / REFERENCES, key, len(prompt_ids)) if opts.timing == "none" else None
    try:
        for i, ids in enumerate(prompt_ids):
            note(f"prompt {i + 1}/{len(prompt_ids)}: {len(ids)} tokens, {time.perf_counter() - started:.0f} s so far")
            if known is not None:  # M needs only the greedy continuation, which a previous run recorded
                ref = Reference(known["references"][i], len(known["references"][i]), known["seconds"][i])
            else:
                ref = base.generate(ids, drafter=NoneDrafter(), max_new_tokens=opts.max_new_tokens)
            references.append(ref.output_token_ids)
            base_tokens, base_seconds = base_tokens + ref.new_tokens, base_seconds + ref.seconds
            hidden = reference_hidden(model, ids, ref.output_token_ids) if fed else None  # [N, H]
            for k in keys:
                drafter = _drafter(k[0], k[1], parts=parts)
                bind_drafter(model, drafter)  # a dense part built with another model is refused here
                r = replay(
                    drafter,
                    ids,
                    ref.output_token_ids,
                    max_nodes=opts.max_nodes,
                    max_new_tokens=opts.max_new_tokens,
                    max_positions=max_positions,
                    hidden=hidden,
                )
                row = acc[_key(k)]
                row["tokens"] += r.new_tokens
                row["steps"] += r.steps
                row["draft"] += r.draft_seconds
                if i < opts.check and k[0] != "none" and k[1] is largest[k[0]]:
                    real = fixed.generate(
                        ids,
                        drafter=_drafter(k[0], k[1], parts=timing_parts),
                        max_new_tokens=opts.max_new_tokens,
                    )
                    checks.append(
                        {
                            "prompt": i,
                            "drafter": k[0],
                            "variant": k[1].name if k[1] else None,
                            "replay_steps": r.steps,
                            "real_steps": real.forward_passes,
                            "replay_m": r.new_tokens / max(1, r.steps),
                            "real_m": real.mean_accepted_length,
                            "same_output": real.output_token_ids == ref.output_token_ids,
                            "equal": r.steps == real.forward_passes,
                        }
                    )
            for k in timed[i % max(1, len(timed)) :] + timed[: i % max(1, len(timed))]:  # rotate the order
                drafter = _drafter(k[0], k[1], parts=timing_parts)
                result = gens[_key(k)].generate(ids, drafter=drafter, max_new_tokens=opts.max_new_tokens)
                row = acc[_key(k)]
                row["real_tokens"] += result.new_tokens
                row["real_seconds"] += result.seconds
                row["real_steps"] += result.forward_passes
                row["exact"] += int(result.output_token_ids == ref.output_token_ids)
    finally:
        for handle in (*stores.values(), *timing_stores.values(), *dense_parts.values()):
            handle.close()
    if known is None:
        record_references(out, loaded, prompt_ids, opts, references, base_seconds / max(1, len(prompt_ids)))
    base_rate = base_tokens / max(base_seconds, 1e-9)
    rows = []
    for k in keys:
        row, variant = acc[_key(k)], k[1]
        real = None
        if k[0] == "none":
            real = {
                "mean_accepted_length": 1.0,
                "tokens_per_second": base_rate,
                "speedup": 1.0,
                "exact": len(prompt_ids),
            }
        elif row["real_steps"]:
            rate = row["real_tokens"] / max(row["real_seconds"], 1e-9)
            real = {
                "mean_accepted_length": row["real_tokens"] / row["real_steps"],
                "tokens_per_second": rate,
                "speedup": rate / base_rate,
                "exact": row["exact"],
            }
        rows.append(
            {
                "drafter": k[0],
                "datastore": variant.name if variant else None,
                "kind": variant.kind if variant else None,
                "percent": variant.percent if variant else None,
                "top_t": variant.top_t if variant else None,
                "positions": variant.positions if variant else None,
                "bytes": variant.nbytes if variant else 0,
                "mean_accepted_length": row["tokens"] / max(1, row["steps"]),
                "new_tokens": row["tokens"],
                "steps": row["steps"],
                "draft_ms_median": _pct_ms(row["draft"], 50),
                "draft_ms_p99": _pct_ms(row["draft"], 99),
                "real": real,
            }
        )
    return {"rows": rows, "crosscheck": checks, "references": references}


def _key(k: tuple[str, Variant | None]) -> str:
    return f"{k[0]}@{k[1].name if k[1] else '-'}"
