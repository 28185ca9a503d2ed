"""`crest bench learn`: what learning from served outputs buys, measured by replaying a stream of requests in order.

The prompts are served in order, greedy; request i may draft only from what requests 0..i-1 taught (with
`refresh_every` K, from the requests before the last multiple of K). Each finished request teaches its store what
the server records (`crest.learning.requests.served_tokens`) as much as a live tier counts of it (the prompt's last
max-n tokens, then the output: `crest.learning.journal.counted_from`), and the live tier is rebuilt from the last
`window` of those tokens with the code `crest.learning.refresh_live` builds a live version with
(`crest.bench.live_memory`: the same selection, `min_count` filter, `build_trees` and blob encoding, on the static
version's tokenizer and build options), but kept in memory instead of published: publishing
one version per request would time the database, not the drafts, and nothing is ever written to the user's stores.
The live trees are looked up as the SDK reads a live tier (`crest_client.choice.rule_for`), the static tier through
the SDK. M (new tokens per target forward) is measured by replay on the plain greedy continuations, as `crest bench
accept` does (trees cut to `max_nodes`), and again with each step's tree cut to the size the generator's adaptive
sizing picks (`crest.bench.adaptive`, under the pinned quiet-CPU cost model or a calibrated one); each row's draft
latency is timed; live lookups run in memory here, where a server gets both tiers in one round trip. Rows: prompt
lookup; the static tier, the live tier and both (merged by `StoreDrafter` as served), each alone and merged with
prompt lookup (as `crest+prompt`); with `rest`, REST over the static store's corpus as a reference. Storage: the
stream's learned rows, repeated to 1M tokens, are loaded into a temporary copy of `crest_learned` (gone at the end
of the session) and measured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from crest_client.draft import Draft

from crest.bench.accept import AcceptOptions
from crest.bench.adaptive import estimated_speedup, quiet_cpu_cost
from crest.bench.live_memory import LiveTrees, learned_window
from crest.bench.references import REFERENCES, known_references, reference_key
from crest.bench.replay import Replay, replay
from crest.bench.stream import prepare_stream
from crest.config import DEFAULT_LEARN_WINDOW, IngestOptions
from crest.decoding.drafter import Drafter, NoneDrafter
from crest.decoding.policy import DraftPolicy
from crest.decoding.sizing import CostModel
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.store import StoreDrafter
from crest.errors import ConfigError
from crest.learning.live import DEFAULT_MIN_COUNT

ROWS = ("prompt", "static", "live", "static+live", "static+prompt", "live+prompt", "static+live+prompt")
REST_ROW = "rest"  # a reference: REST over the static store's corpus, which learns nothing

_STORAGE_TOKENS = 1_000_000  # learned tokens loaded to measure the log's bytes per 1M served tokens


@dataclass(frozen=True)
class LearnOptions:
    """What one `crest bench learn` run measures."""

    store: str
    prompts: str = "humaneval"
    chat: bool = False
    limit: int | None = None
    max_new_tokens: int = 128
    max_nodes: int = 64
    refresh_every: int = 1
    window: int = DEFAULT_LEARN_WINDOW
    min_count: int = DEFAULT_MIN_COUNT
    references: str | None = None
    rest: tuple[str, ...] = ()  # the static store's corpus (files, directories, globs): adds the REST row
    calibrate: bool = False  # adaptive size under a measured cost model instead of the pinned quiet-CPU one
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> LearnOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        for label, value in (
            ("--max-new-tokens", self.max_new_tokens),
            ("--max-nodes", self.max_nodes),
            ("--refresh-every", self.refresh_every),
            ("--window", self.window),
            ("--min-count", self.min_count),
            ("--limit", 1 if self.limit is None else self.limit),
        ):
            if value < 1:
                raise ConfigError(f"{label} must be at least 1, got {value}")
        return self


def learned_rows(i: int, *, refresh_every: int = 1) -> int:
    """Return how many finished requests the live tier holds while request `i` is served (0: no live tier yet)."""
    return i - i % refresh_every


class _Tiers:
    """A store handle for `StoreDrafter`: the static tier through the SDK, the live tier (when built) in memory."""

    def __init__(self, static: Any, live: LiveTrees | None) -> None:
        self.static, self.live = static, live

    def draft(self, context_ids: Sequence[int], max_nodes: int = 64) -> Draft | None:
        """Return the static tier's draft."""
        return self.draft_parts(context_ids, max_nodes)[0]

    def draft_parts(self, context_ids: Sequence[int], max_nodes: int = 64) -> list[Draft | None]:
        """Return [static draft, live draft] for the context."""
        static = self.static.draft_parts(context_ids, max_nodes=max_nodes)[0] if self.static is not None else None
        return [static, self.live.draft(context_ids, max_nodes) if self.live is not None else None]


def make_row_drafter(name: str, *, static: Any, live: LiveTrees | None) -> Drafter:
    """Return one row's drafter: its tiers through `StoreDrafter`, merged with prompt lookup when it ends in +prompt."""
    if name == "prompt":
        return PromptDrafter()
    tiers = name.removesuffix("+prompt")
    if name not in ROWS:
        raise ConfigError(f"unknown row {name!r}: use one of {', '.join(ROWS)}")
    base: Drafter = NoneDrafter()  # no live version yet: the live tier drafts nothing
    if tiers != "live" or live is not None:
        base = StoreDrafter(_Tiers(static if "static" in tiers else None, live if "live" in tiers else None))
    return MergedDrafter(base, PromptDrafter()) if name.endswith("+prompt") else base


def stream(
    opts: LearnOptions,
    *,
    prompt_ids: list[list[int]],
    references: list[list[int]],
    static_stores: dict[str, Any],
    vocab_size: int,
    options: IngestOptions,
    max_positions: int,
    cost: CostModel | None = None,
    rest_index: Any = None,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Serve the prompts in order, replay every row on each, and learn each finished request; return the figures.

    With `cost`, each row is also replayed with the adaptive size (one drafting policy per row for the whole
    stream); with `rest_index`, a REST row drafts from it.
    """
    from crest.drafters.registry import make_drafter
    from crest.learning.journal import counted_from
    from crest.learning.requests import served_tokens

    names = (*ROWS, REST_ROW) if rest_index is not None else ROWS
    rest: Drafter | None = make_drafter(REST_ROW, rest_index=rest_index) if rest_index is not None else None
    replays: dict[str, list[Replay]] = {name: [] for name in names}
    sized: dict[str, list[Replay]] = {name: [] for name in names}
    sizers = {name: DraftPolicy(budget=opts.max_nodes, cost=cost) for name in names} if cost is not None else {}
    play = partial(replay, max_nodes=opts.max_nodes, max_new_tokens=opts.max_new_tokens, max_positions=max_positions)
    per_request: list[dict[str, Any]] = []
    learned: list[list[int]] = []
    live: LiveTrees | None = None
    built_from, builds = 0, []
    for i, (ids, ref) in enumerate(zip(prompt_ids, references, strict=True)):
        rows = learned_rows(i, refresh_every=opts.refresh_every)
        if rows != built_from:  # a refresh after the last K finished requests
            t0 = time.perf_counter()
            tokens, offsets = learned_window(learned[:rows], window=opts.window)
            live = LiveTrees.build(tokens, offsets, vocab_size=vocab_size, options=options, min_count=opts.min_count)
            builds.append(time.perf_counter() - t0)
            built_from = rows
        record: dict[str, Any] = {"request": i, "learned_requests": rows, "live_ngrams": len(live.rows) if live else 0}
        drafters = {name: make_row_drafter(name, static=static_stores.get(name), live=live) for name in ROWS}
        if rest is not None:
            drafters[REST_ROW] = rest
        for name, drafter in drafters.items():
            r = play(drafter, ids, ref)
            replays[name].append(r)
            record[name] = round(r.new_tokens / max(1, r.steps), 4)
            if name in sizers:
                a = play(drafter, ids, ref, policy=sizers[name])
                sized[name].append(a)
                record[f"{name} adaptive"] = round(a.new_tokens / max(1, a.steps), 4)
        per_request.append(record)
        note(f"request {i + 1}/{len(prompt_ids)}: static+live+prompt M {record['static+live+prompt']:.2f}")
        row, tail = served_tokens(ids, ref)
        learned.append(row[counted_from(tail, max_n=options.max_n) :])  # what a live tier counts of the row
    final = LiveTrees.build(
        *learned_window(learned, window=opts.window), vocab_size=vocab_size, options=options, min_count=opts.min_count
    )
    return {
        "rows": [_row(name, done, sized[name], cost) for name, done in replays.items()],
        "per_request": per_request,
        "learned": learned,
        "live_builds": len(builds),
        "live_build_ms_mean": round(1e3 * float(np.mean(builds or [0.0])), 2),
        "final_live": {"ngrams": len(final.rows), "estimated_bytes": final.nbytes},
    }


def _row(name: str, replays: list[Replay], sized: list[Replay], cost: CostModel | None) -> dict[str, Any]:
    """Return one row of the table: M over the stream and the draft latency (ms) of its steps; adaptive M too."""
    tokens, steps = sum(r.new_tokens for r in replays), sum(r.steps for r in replays)
    seconds = [t for r in replays for t in r.draft_seconds]
    ms = 1e3 * np.asarray(seconds or [0.0])
    row: dict[str, Any] = {
        "drafter": name,
        "mean_accepted_length": round(tokens / max(1, steps), 4),
        "new_tokens": tokens,
        "steps": steps,
        "draft_ms_mean": round(float(ms.mean()), 4),
        "draft_ms_p99": round(float(np.percentile(ms, 99)), 4),
    }
    if cost is None or not sized:
        return row
    a_tokens, a_steps = sum(a.new_tokens for a in sized), sum(a.steps for a in sized)
    nodes = [k for a in sized for k in a.nodes]
    a_seconds = [t for a in sized for t in a.draft_seconds]
    full = [k for r in replays for k in r.nodes]
    return row | {
        "adaptive_mean_accepted_length": round(a_tokens / max(1, a_steps), 4),
        "adaptive_nodes_mean": round(float(np.mean(nodes or [0])), 2),
        "est_speedup_64": round(estimated_speedup(tokens, full, seconds, cost), 3),
        "est_speedup_adaptive": round(estimated_speedup(a_tokens, nodes, a_seconds, cost), 3),
    }


def learned_storage(dsn: str, store: str, rows: Sequence[Sequence[int]], *, prompt_tokens: int) -> dict[str, Any]:
    """Return the on-disk bytes of `rows` as learned rows per 1M tokens, measured in a temporary `crest_learned`."""
    import psycopg

    from crest.drafting.hub import process_source
    from crest.learning.journal import encode_tokens

    tokens = sum(len(r) for r in rows)
    if not tokens:
        return {"tokens": 0, "rows": 0, "bytes_per_million_tokens": None}
    repeat = -(-_STORAGE_TOKENS // tokens)  # ceil: enough copies for page rounding not to matter
    source = process_source("serve")
    encoded = [(store, encode_tokens(r), len(r), min(prompt_tokens, len(r)), source) for r in rows if len(r)]
    with psycopg.connect(dsn) as conn:  # never committed: the temporary table is gone with the transaction
        conn.execute("CREATE TEMP TABLE crest_learned_probe (LIKE crest_learned INCLUDING ALL) ON COMMIT DROP")
        query = "COPY crest_learned_probe (store, tokens, n_tokens, prompt_tokens, source) FROM STDIN (FORMAT BINARY)"
        with conn.cursor() as cur, cur.copy(query) as copy:
            copy.set_types(["text", "bytea", "int4", "int4", "text"])
            for _ in range(repeat):
                for row in encoded:
                    copy.write_row(row)
        found = conn.execute("SELECT pg_total_relation_size('crest_learned_probe')").fetchone()
        conn.rollback()
    total = int(found[0]) if found else 0
    return {
        "tokens": tokens,
        "rows": len(encoded),
        "bytes_per_million_tokens": round(total * 1e6 / (tokens * repeat)),
        "bytes_per_token": round(total / (tokens * repeat), 2),
    }


def run_learn(
    opts: LearnOptions,
    *,
    model: str,
    dsn: str,
    out: Path,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Replay the stream with learning and return its results (also written as learn.json and learn.md in `out`)."""
    from crest_client import Store

    from crest.bench.results import append_notes, save_run
    from crest.decoding.generator import SpeculativeGenerator
    from crest.decoding.sizing import calibrate

    started = time.time()
    opts.validate()
    prepared = prepare_stream(opts, model=model, dsn=dsn)
    static, options, fingerprint = prepared.version, prepared.options, prepared.fingerprint
    loaded, prompt_ids, prompts = prepared.loaded, prepared.prompt_ids, prepared.prompts
    base = SpeculativeGenerator(loaded.model, loaded.tokenizer, max_draft_tokens=0)
    key = reference_key(
        loaded, prompt_ids, AcceptOptions(max_new_tokens=opts.max_new_tokens, device=opts.device, dtype=opts.dtype)
    )
    out.mkdir(parents=True, exist_ok=True)
    given = Path(opts.references) if opts.references else out / REFERENCES
    known = known_references(given, key, len(prompt_ids))
    references = known["references"] if known is not None else None
    decoded = references is None
    if references is None:
        note(f"no matching references in {given}: decoding {len(prompt_ids)} prompts plainly")
        references, seconds = [], []
        for i, ids in enumerate(prompt_ids):
            result = base.generate(ids, drafter=NoneDrafter(), max_new_tokens=opts.max_new_tokens)
            references.append(result.output_token_ids)
            seconds.append(result.seconds)
            note(f"reference {i + 1}/{len(prompt_ids)}: {result.new_tokens} tokens in {result.seconds:.1f} s")
        body = {"key": key, "references": references, "seconds": seconds}
        (out / REFERENCES).write_text(json.dumps(body), encoding="utf-8")
    cost = calibrate(loaded.model, on_progress=note) if opts.calibrate else quiet_cpu_cost()
    rest_index = _rest_index(opts.rest, model=model, out=out) if opts.rest else None
    handles = {
        name: Store.connect(dsn, opts.store, tokenizer_fingerprint=fingerprint, timeout=1.0, pool_size=1, live=False)
        for name in ROWS
        if name.startswith("static")
    }
    try:
        measured = stream(
            opts,
            prompt_ids=prompt_ids,
            references=references,
            static_stores=handles,
            vocab_size=int(static["vocab_size"]),
            options=options,
            max_positions=base.max_positions,
            cost=cost,
            rest_index=rest_index,
            note=note,
        )
    finally:
        failed = sum(int(handle.stats["errors"]) for handle in handles.values())  # lookups that drafted nothing
        for handle in handles.values():
            handle.close()
    if failed:
        note(f"{failed} static lookups failed (timed out or the database did not answer): those steps had no draft")
    storage = learned_storage(dsn, opts.store, measured["learned"], prompt_tokens=options.max_n)
    storage |= {"live_version_at_end": measured["final_live"]}
    title = (
        f"crest bench learn: {opts.prompts} on store {opts.store!r} ({len(prompts)} requests in order, "
        f"{opts.max_new_tokens} greedy tokens, {opts.max_nodes}-node trees)"
    )
    results, _ = save_run(
        "learn",
        measured["rows"],
        started=started,
        title=title,
        out=out,
        model=model,
        store=opts.store,
        options=asdict(opts),
        prompts=len(prompts),
        method=(
            f"M by replay of greedy verification on the plain greedy continuations, trees cut to {opts.max_nodes} "
            "nodes, and cut to the size the generator's adaptive sizing picks under the cost model "
            f"({'calibrated' if opts.calibrate else 'pinned quiet-CPU curve'}: one policy per row for the stream); "
            f"request i drafts from a live tier built from requests 0..i - 1 - (i mod {opts.refresh_every}), "
            "built in memory as refresh_live builds it; live lookups in memory, static ones through the SDK"
        ),
        references={"file": str(given if not decoded else out / REFERENCES), "decoded": decoded},
        static_lookup_errors=failed,
        live_builds=measured["live_builds"],
        live_build_ms_mean=measured["live_build_ms_mean"],
        storage=storage,
        cost_model={"calibrated": opts.calibrate} | cost.to_json(),
        rest={"corpus": list(opts.rest), "tokens": len(rest_index)} if rest_index is not None else None,
        per_request=measured["per_request"],
    )
    append_notes(out / "learn.md", _notes(results))
    return results


def _rest_index(inputs: Sequence[str], *, model: str, out: Path) -> Any:
    """Return a REST index over all of `inputs` (the static store's corpus), built in `out` or reused from there."""
    from crest.bench.datastores import Corpus, build_rest_indexes, digest, size_tag
    from crest.drafters.suffix_array import RestIndex

    corpus = Corpus(list(inputs), "auto", digest(["learn", *inputs, *map(size_tag, inputs)]))
    built = build_rest_indexes(
        corpus, tokenizer=model, percents=(100.0,), out=out, seed=0, rebuild=False, setting="learn"
    )
    return RestIndex.load(out / built[0].name)


def _notes(results: dict[str, Any]) -> list[str]:
    """Return the method and the storage figures to add under the markdown table."""
    storage = results["storage"]
    live = storage["live_version_at_end"]
    lines = [
        f"Method: {results['method']}.",
        "",
        f"- Learned log: {storage['bytes_per_million_tokens'] or 0:,} bytes per 1M served tokens "
        f"({storage['rows']} rows, {storage['tokens']:,} tokens in this stream; heap, TOAST and index).",
        f"- Live tier after the stream: {live['ngrams']:,} n-grams, about {live['estimated_bytes']:,} bytes "
        "(estimated rows, index and key filter; the vocabulary copy of each live version not counted).",
        f"- Live rebuilds: {results['live_builds']}, {results['live_build_ms_mean']:.1f} ms each on average.",
        f"- Adaptive size and est. speedups priced by the cost model {results['cost_model']} (seconds per forward).",
        f"- Static lookups that failed (no draft that step): {results['static_lookup_errors']}.",
    ]
    return lines
