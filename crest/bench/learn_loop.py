"""`crest bench learn-loop`: learning through the real decoding loop, timed against model.generate and HF lookup.

Pass 1 serves the prompts in order, greedy. Each prompt is generated, in an order that rotates from prompt to
prompt so machine noise hits every row alike, by plain `model.generate`, by Hugging Face's own prompt lookup
(`model.generate(prompt_lookup_num_tokens=4)` and `=10`), and through `SpeculativeGenerator` with the adaptive
draft size (calibrated forward cost, as `crest generate` runs) by `static+prompt` (the static store merged with
prompt lookup, no learning) and `static+live+prompt` (plus a live tier built in memory, as `crest bench learn`
builds it, from the requests that finished before this one). Every crest output is checked token for token
against `model.generate`'s (exactness); HF's prompt lookup is only noted. Pass 2 asks the same prompts again in
order at a sampling temperature (users who ask again), through the same loop, rows `static+prompt` and
`static+live+prompt` with one seed per prompt, the live tier holding all of pass 1 and the pass-2 requests
finished before. Every prompt and row is one JSON record in `learn_loop_records.jsonl`, written as it goes; the
summary (tokens/s, speedup over `generate`, learning over the better HF prompt lookup, M, acceptance) goes to
`learn_loop.json` and `learn_loop.md`. Nothing is written to the database.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from crest.bench.learn import learned_rows, make_row_drafter
from crest.bench.live_memory import LiveTrees, learned_window
from crest.bench.stream import prepare_stream
from crest.config import DEFAULT_LEARN_WINDOW, IngestOptions
from crest.errors import ConfigError
from crest.learning.live import DEFAULT_MIN_COUNT

HF_ROWS = {"generate": 0, "hf-lookup-4": 4, "hf-lookup-10": 10}  # row: prompt_lookup_num_tokens (0: plain)
CREST_ROWS = ("static+prompt", "static+live+prompt")
GREEDY_ROWS = (*HF_ROWS, *CREST_ROWS)
LEARNING = "static+live+prompt"
RECORDS = "learn_loop_records.jsonl"


@dataclass(frozen=True)
class LoopOptions:
    """What one `crest bench learn-loop` run measures."""

    store: str
    prompts: str = "humaneval"
    chat: bool = False
    limit: int | None = None
    max_new_tokens: int = 128
    refresh_every: int = 1
    window: int = DEFAULT_LEARN_WINDOW
    min_count: int = DEFAULT_MIN_COUNT
    temperature: float = 0.8
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> LoopOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        for label, value in (
            ("--max-new-tokens", self.max_new_tokens),
            ("--refresh-every", self.refresh_every),
            ("--window", self.window),
            ("--min-count", self.min_count),
            ("--limit", 1 if self.limit is None else self.limit),
        ):
            if value < 1:
                raise ConfigError(f"{label} must be at least 1, got {value}")
        if not 0.0 < self.temperature <= 100.0:
            raise ConfigError(f"--temperature must be in (0, 100] (the second pass samples), got {self.temperature}")
        return self


def rotated(rows: Sequence[str], index: int) -> list[str]:
    """Return the rows in prompt `index`'s order: the list rotated left by `index` places."""
    k = index % len(rows)
    return [*rows[k:], *rows[:k]]


def generate_hf(
    model: Any, tokenizer: Any, prompt_ids: Sequence[int], *, max_new_tokens: int, lookup: int = 0
) -> tuple[list[int], float]:
    """Return `model.generate`'s greedy output ids and wall seconds; `lookup` > 0 turns on HF's prompt lookup."""
    from crest.decoding.generator import eos_ids

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)
    eos = eos_ids(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None)
    extra: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.no_grad():
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad if pad is not None else (min(eos) if eos else 0),
            **extra,
        )
    out = full[0, ids.shape[1] :].tolist()  # synchronises
    return out, time.perf_counter() - start


class _Live:
    """The in-memory live tier of a stream: learned rows and the trees last built from them."""

    def __init__(self, opts: LoopOptions, *, vocab_size: int, options: IngestOptions, max_n: int) -> None:
        self.opts, self.vocab_size, self.options, self.max_n = opts, vocab_size, options, max_n
        self.learned: list[list[int]] = []
        self.trees: LiveTrees | None = None
        self.built_from = 0
        self.build_seconds: list[float] = []

    def before(self, request: int) -> int:
        """Rebuild the trees when a refresh falls before request `request`; return the learned requests they hold."""
        rows = learned_rows(request, refresh_every=self.opts.refresh_every)
        if rows != self.built_from:
            t0 = time.perf_counter()
            tokens, offsets = learned_window(self.learned[:rows], window=self.opts.window)
            self.trees = LiveTrees.build(
                tokens, offsets, vocab_size=self.vocab_size, options=self.options, min_count=self.opts.min_count
            )
            self.build_seconds.append(time.perf_counter() - t0)
            self.built_from = rows
        return rows

    def learn(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Record what a live tier counts of a finished request's row: the prompt's last max-n ids, then the output."""
        from crest.learning.journal import counted_from
        from crest.learning.requests import served_tokens

        row, tail = served_tokens(prompt, output)
        self.learned.append(row[counted_from(tail, max_n=self.max_n) :])


def loop(
    opts: LoopOptions,
    *,
    loaded: Any,
    prompt_ids: list[list[int]],
    static: Any,
    vocab_size: int,
    options: IngestOptions,
    records: TextIO | None = None,
    note: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Run both passes over the prompts, interleaved per prompt; return the records (also written to `records`)."""
    from crest.decoding.generator import SpeculativeGenerator
    from crest.decoding.sizing import calibrate

    cost = calibrate(loaded.model, on_progress=note)
    gens = {  # one per row and pass: each learns its own acceptance estimate; the cost model is shared
        (p, name): SpeculativeGenerator(loaded.model, loaded.tokenizer, cost=cost)
        for p in (1, 2)
        for name in CREST_ROWS
    }
    live = _Live(opts, vocab_size=vocab_size, options=options, max_n=options.max_n)
    done: list[dict[str, Any]] = []
    _warm_up(loaded, prompt_ids[0], static=static, cost=cost)

    def keep(line: dict[str, Any]) -> None:
        done.append(line)
        if records is not None:
            records.write(json.dumps(line) + "\n")
            records.flush()

    n = len(prompt_ids)
    for i, ids in enumerate(prompt_ids):
        learned = live.before(i)
        outputs: dict[str, list[int]] = {}
        lines: dict[str, dict[str, Any]] = {}
        for order, name in enumerate(rotated(GREEDY_ROWS, i)):
            base = {"pass": 1, "prompt": i, "row": name, "order": order, "learned_requests": learned}
            if name in HF_ROWS:
                out, seconds = generate_hf(
                    loaded.model, loaded.tokenizer, ids, max_new_tokens=opts.max_new_tokens, lookup=HF_ROWS[name]
                )
                outputs[name] = out
                lines[name] = base | _figures(len(out), seconds, forwards=None)
            else:
                drafter = make_row_drafter(name, static=static, live=live.trees if name == LEARNING else None)
                lines[name], outputs[name] = _crest(gens[(1, name)], drafter, ids, opts, base, seed=None)
        for name in GREEDY_ROWS:
            keep(lines[name] | {"identical": outputs[name] == outputs["generate"]})
        live.learn(ids, outputs[LEARNING])
        rates = {k: lines[k]["new_tokens"] / max(lines[k]["seconds"], 1e-9) for k in GREEDY_ROWS}
        note(
            f"greedy {i + 1}/{n}: learning {rates[LEARNING] / max(rates['generate'], 1e-9):.2f}x generate, "
            f"M {lines[LEARNING]['mean_accepted_length']:.2f}"
            + ("" if outputs[LEARNING] == outputs["generate"] else " (NOT IDENTICAL to model.generate)")
        )
    for i, ids in enumerate(prompt_ids):
        learned = live.before(n + i)
        seed = opts.seed + i
        sampled: dict[str, tuple[dict[str, Any], list[int]]] = {}
        for order, name in enumerate(rotated(CREST_ROWS, i)):
            base = {"pass": 2, "prompt": i, "row": name, "order": order, "learned_requests": learned}
            drafter = make_row_drafter(name, static=static, live=live.trees if name == LEARNING else None)
            sampled[name] = _crest(gens[(2, name)], drafter, ids, opts, base, seed=seed)
        for name in CREST_ROWS:
            keep(sampled[name][0] | {"identical": None, "seed": seed})
        live.learn(ids, sampled[LEARNING][1])  # what the server with learning served
        note(
            f"temperature {opts.temperature} {i + 1}/{n}: learning M {sampled[LEARNING][0]['mean_accepted_length']:.2f}"
        )
    return done


def _warm_up(loaded: Any, ids: list[int], *, static: Any, cost: Any) -> None:
    """Run every kind of row once for a few tokens, untimed, so no row pays the process's first-call costs."""
    from crest.decoding.generator import SpeculativeGenerator

    for lookup in HF_ROWS.values():
        generate_hf(loaded.model, loaded.tokenizer, ids, max_new_tokens=4, lookup=lookup)
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, cost=cost)  # thrown away: its estimate is not kept
    gen.generate(ids, drafter=make_row_drafter("static+prompt", static=static, live=None), max_new_tokens=4)


def _crest(
    gen: Any, drafter: Any, ids: list[int], opts: LoopOptions, base: dict[str, Any], *, seed: int | None
) -> tuple[dict[str, Any], list[int]]:
    """Generate one prompt through the speculative loop; return its record and output ids."""
    sampling: dict[str, Any] = {"temperature": opts.temperature, "seed": seed} if seed is not None else {}
    start = time.perf_counter()
    result = gen.generate(ids, drafter=drafter, max_new_tokens=opts.max_new_tokens, **sampling)
    seconds = time.perf_counter() - start
    line = base | _figures(result.new_tokens, seconds, forwards=result.forward_passes)
    accepted = result.new_tokens - result.forward_passes  # every forward emits one token of the target's own
    line |= {"draft_tokens": result.draft_tokens, "accepted_draft_tokens": accepted}
    line |= {"draft_seconds": round(result.draft_seconds, 6), "stop_reason": result.stop_reason}
    return line, list(result.output_token_ids)


def _figures(new_tokens: int, seconds: float, *, forwards: int | None) -> dict[str, Any]:
    m = round(new_tokens / max(1, forwards), 4) if forwards is not None else None
    return {
        "new_tokens": new_tokens,
        "seconds": round(seconds, 5),
        "forward_passes": forwards,
        "mean_accepted_length": m,
    }


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one row per pass and row: tokens/s over its prompts, speedup over generate, M, acceptance, exactness."""
    out: list[dict[str, Any]] = []
    for pas, names in ((1, GREEDY_ROWS), (2, CREST_ROWS)):
        mine = {name: [r for r in records if r["pass"] == pas and r["row"] == name] for name in names}
        rate = {k: sum(r["new_tokens"] for r in v) / max(sum(r["seconds"] for r in v), 1e-9) for k, v in mine.items()}
        for name, rows in mine.items():
            if not rows:
                continue
            tokens = sum(r["new_tokens"] for r in rows)
            crest = name in CREST_ROWS
            forwards = sum(r["forward_passes"] or 0 for r in rows)
            drafted = sum(r.get("draft_tokens", 0) for r in rows)
            accepted = sum(r.get("accepted_draft_tokens", 0) for r in rows)
            out.append(
                {
                    "pass": "greedy" if pas == 1 else "sampled",
                    "row": name,
                    "prompts": len(rows),
                    "new_tokens": tokens,
                    "tokens_per_second": round(rate[name], 3),
                    "speedup_vs_generate": round(rate[name] / rate["generate"], 4) if "generate" in rate else None,
                    "mean_accepted_length": round(tokens / max(1, forwards), 4) if crest else None,
                    "acceptance": round(accepted / drafted, 4) if crest and drafted else None,
                    "identical": sum(bool(r["identical"]) for r in rows) if pas == 1 else None,
                }
            )
    return out


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the issue's wall-clock figures: learning over generate and over the better HF prompt lookup."""
    greedy = {r["row"]: r for r in rows if r["pass"] == "greedy"}
    best = max(("hf-lookup-4", "hf-lookup-10"), key=lambda k: greedy[k]["tokens_per_second"])
    learning = greedy[LEARNING]["tokens_per_second"]
    over_hf = learning / max(greedy[best]["tokens_per_second"], 1e-9)
    return {
        "learning_vs_generate": greedy[LEARNING]["speedup_vs_generate"],
        "best_hf_lookup": best,
        "learning_vs_best_hf_lookup": round(over_hf, 4),
        "crest_mismatches": sum(greedy[k]["prompts"] - greedy[k]["identical"] for k in CREST_ROWS),
        "hf_lookup_mismatches": {
            k: greedy[k]["prompts"] - greedy[k]["identical"] for k in ("hf-lookup-4", "hf-lookup-10")
        },
    }


def run_learn_loop(
    opts: LoopOptions,
    *,
    model: str,
    dsn: str,
    out: Path,
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run both passes and return the results (also written as learn_loop.json, .md and the records to `out`)."""
    from crest_client import Store

    from crest.bench.results import append_notes, open_records, save_run

    started = time.time()
    opts.validate()
    prepared = prepare_stream(opts, model=model, dsn=dsn)
    version, options, fingerprint = prepared.version, prepared.options, prepared.fingerprint
    loaded, prompt_ids, prompts = prepared.loaded, prepared.prompt_ids, prepared.prompts
    out.mkdir(parents=True, exist_ok=True)
    static = Store.connect(dsn, opts.store, tokenizer_fingerprint=fingerprint, timeout=1.0, pool_size=1, live=False)
    try:
        with open_records(out / RECORDS) as stream:
            records = loop(
                opts,
                loaded=loaded,
                prompt_ids=prompt_ids,
                static=static,
                vocab_size=int(version["vocab_size"]),
                options=options,
                records=stream,
                note=note,
            )
    finally:
        failed = int(static.stats["errors"])  # lookups that drafted nothing
        static.close()
    rows = summarize(records)
    figures = headline(rows)
    if figures["crest_mismatches"]:
        note(f"{figures['crest_mismatches']} crest outputs differ from model.generate's: see {out / RECORDS}")
    title = (
        f"crest bench learn-loop: {opts.prompts} on store {opts.store!r} ({len(prompts)} requests in order, "
        f"{opts.max_new_tokens} new tokens; greedy, then again at temperature {opts.temperature})"
    )
    results, _ = save_run(
        "learn_loop",
        rows,
        started=started,
        title=title,
        out=out,
        model=model,
        store=opts.store,
        options=asdict(opts),
        prompts=len(prompts),
        method=(
            "wall clock of each whole generate call, rows interleaved per prompt in a rotating order; crest rows "
            "through SpeculativeGenerator with the adaptive draft size (calibrated cost); request i drafts from a "
            f"live tier built in memory from requests 0..i - 1 - (i mod {opts.refresh_every}) as refresh_live "
            "builds it (pass 2 continues the stream after pass 1); rebuilds are not timed in any row"
        ),
        headline=figures,
        static_lookup_errors=failed,
        records=str(out / RECORDS),
    )
    append_notes(out / "learn_loop.md", _notes(results))
    return results


def _notes(results: dict[str, Any]) -> list[str]:
    """Return the headline figures and the method to add under the markdown table."""
    h = results["headline"]
    lines = [
        f"- crest+prompt with learning: {h['learning_vs_generate']}x model.generate, "
        f"{h['learning_vs_best_hf_lookup']}x HF prompt lookup at its better setting, {h['best_hf_lookup']}.",
        f"- crest outputs differing from model.generate (greedy): {h['crest_mismatches']}; HF prompt lookup: "
        + ", ".join(f"{k} {v}" for k, v in h["hf_lookup_mismatches"].items())
        + ".",
        f"- Static lookups that failed (no draft that step): {results['static_lookup_errors']}.",
        "",
        f"Method: {results['method']}. Records: {results['records']}.",
    ]
    return lines
