"""`crest bench accept`: mean accepted length against datastore size, crest against REST, as in the CREST paper.

For one model, corpus and prompt set it builds REST suffix-array indexes over seeded random samples of the corpus
documents (1% .. 100%) and crest stores at several top-t values, then for every prompt runs plain greedy decoding
once (the `none` drafter, which gives the reference continuation and the baseline speed) and measures each drafter
and size. Mean accepted length M (new tokens per target forward) is measured by *replay*: greedy verification
accepts exactly the longest draft path that matches the greedy continuation, so replaying the drafter on the
contexts of the known continuation, with the verifier's tree cut (`max_nodes` nodes, depth within the tokens left),
gives the M of the real loop with `--max-draft-tokens max_nodes` without running the model again; a cross-check
runs that real loop on a few prompts and records both. Tokens/s and the speedup over `none` come from real
generation (the default adaptive draft size) and are measured for the sizes `timing` asks for. A run records the
plain greedy continuations in `references.json`; a later `--timing none` run on the same model, prompts and length
replays on them without decoding again. The ablations (single n, n <= m) and the table of average tree sizes follow
the paper's Figures 8-9 and Table 2. Results go to `accept.json`, `accept.md` and PNG plots in the output folder.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from crest.bench.datastores import (
    Corpus,
    Variant,
    auto_top_t,
    build_rest_indexes,
    build_store,
    digest,
    hold_out,
    mt_bench_path,
    sharegpt_path,
    size_tag,
    stdlib_files,
)
from crest.bench.references import Reference, known_references, record_references
from crest.bench.replay import replay
from crest.config import KEEP_RULES, IngestOptions
from crest.decoding.drafter import Drafter, NoneDrafter
from crest.decoding.sizing import calibrate
from crest.drafters.registry import make_drafter, names
from crest.errors import ConfigError, CorpusError

SETTINGS = ("chat", "code")
REST_PERCENTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0)
TIMING = ("all", "largest", "none")


@dataclass(frozen=True)
class AcceptOptions:
    """What one `crest bench accept` run measures."""

    setting: str | None = None  # chat | code: fills corpus, prompts and hold-out
    corpus: tuple[str, ...] = ()
    fmt: str = "auto"
    prompts: str | None = None
    chat: bool = False
    drafters: tuple[str, ...] = names("bench")
    percents: tuple[float, ...] = REST_PERCENTS
    top_t: tuple[int, ...] = ()  # empty: chosen to give sizes in REST's range
    keep: tuple[str, ...] = ("count",)  # savings, marginal: also a store per top-t at the count store's bytes
    suffix_rule: str = "lookup"  # the tree each row holds (crest.ingest.suffixes); backoff stores are named _backoff
    max_n: int = 4
    limit: int | None = None
    max_new_tokens: int = 128
    max_nodes: int = 64
    holdout: int = 200
    seed: int = 0
    timing: str = "largest"
    max_draft_tokens: int | None = None
    check: int = 1
    ablations: bool = False
    ablation_top_t: tuple[int, ...] = ()
    ablation_limit: int = 20
    rebuild: bool = False
    mt_bench: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> AcceptOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        if self.setting is not None and self.setting not in SETTINGS:
            raise ConfigError(f"unknown setting {self.setting!r}: use chat or code")
        if self.setting is None and not (self.corpus and self.prompts):
            raise ConfigError("give --setting chat|code, or --corpus and --prompts")
        known = names("bench")
        bad = [d for d in self.drafters if d not in known]
        if bad or not self.drafters:
            raise ConfigError(f"unknown drafter(s) {', '.join(bad) or '(none given)'}: use {', '.join(known)}")
        if not self.percents or any(not 0 < p <= 100 for p in self.percents):
            raise ConfigError("--sizes are percentages of the corpus documents in (0, 100]")
        if any(t < 1 for t in (*self.top_t, *self.ablation_top_t)):
            raise ConfigError("--top-t values must be positive")
        if any(k not in KEEP_RULES for k in self.keep):
            raise ConfigError(f"unknown --keep {','.join(self.keep)!r}: use count, savings or marginal")
        if self.timing not in TIMING:
            raise ConfigError(f"--timing must be one of {', '.join(TIMING)}")
        if min(self.max_new_tokens, self.max_nodes, self.max_n) < 1 or self.holdout < 0 or self.check < 0:
            raise ConfigError("--max-new-tokens, --max-nodes and --max-n must be positive")
        return self


def prepare_corpus(opts: AcceptOptions, out: Path) -> Corpus:
    """Return the run's corpus: a preset's (hold-out removed, written to `out`) or the given inputs."""
    if opts.corpus:
        inputs = list(opts.corpus)
        return Corpus(inputs, opts.fmt, digest(["given", opts.fmt, *inputs, *map(size_tag, inputs)]))
    if opts.setting == "code":
        files = stdlib_files()
        return Corpus(files, "files", digest(["code", *files, *map(size_tag, files)]))
    source = sharegpt_path()
    key = digest(["chat", str(source), size_tag(str(source)), str(opts.holdout), str(opts.seed)])
    target, held = out / f"chat_corpus_{key[:8]}.jsonl", out / f"chat_heldout_{key[:8]}.json"
    if opts.rebuild or not (target.exists() and held.exists()):
        prompts = hold_out(source, target, count=opts.holdout, seed=opts.seed)
        held.write_text(json.dumps(prompts, ensure_ascii=False))
    return Corpus([str(target)], "jsonl", key, json.loads(held.read_text()))


def prepare_prompts(opts: AcceptOptions, corpus: Corpus) -> tuple[list[str], bool]:
    """Return the prompts (first `limit`) and whether to apply the chat template."""
    from crest.bench.prompts import load_prompts

    if opts.prompts:
        prompts, chat = load_prompts(opts.prompts), opts.chat
    elif opts.setting == "code":
        prompts, chat = load_prompts("humaneval"), False
    else:
        prompts, chat = load_prompts(str(mt_bench_path(opts.mt_bench))) + corpus.heldout_prompts, True
    return (prompts[: opts.limit] if opts.limit else prompts), chat


def _generator(model: Any, tokenizer: Any, *, max_draft_tokens: int | None, cost: Any) -> Any:
    """Return a fresh generator (its own acceptance estimate) sharing the calibrated cost model."""
    from crest.decoding.generator import SpeculativeGenerator

    # the cost model is calibrated once per model; each drafter keeps its own acceptance statistics
    return SpeculativeGenerator(model, tokenizer, max_draft_tokens=max_draft_tokens, cost=cost)


def _drafter(name: str, variant: Variant | None, *, stores: dict[str, Any], indexes: dict[str, Any]) -> Drafter:
    """Return the registry's drafter `name` on the store or REST index of `variant`."""
    key = variant.name if variant else ""
    return make_drafter(name, store=stores.get(key), rest_index=indexes.get(key))


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
    keys: list[tuple[str, Variant | None]] = []
    for name in opts.drafters:
        sizes = rest if name == "rest" else crest if name.startswith("crest") else [None]
        keys += [(name, v) for v in sizes]
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
    known = known_references(out, loaded, prompt_ids, opts) if opts.timing == "none" else None
    try:
        for i, ids in enumerate(prompt_ids):
            note(f"prompt {i + 1}/{len(prompt_ids)}: {len(ids)} tokens, {time.perf_counter() - started:.0f} s so far")
            if known is not None:  # M needs only the greedy continuation, which a previous run recorded
                ref = Reference(known["references"][i], len(known["references"][i]), known["seconds"][i])
            else:
                ref = base.generate(ids, drafter=NoneDrafter(), max_new_tokens=opts.max_new_tokens)
            references.append(ref.output_token_ids)
            base_tokens, base_seconds = base_tokens + ref.new_tokens, base_seconds + ref.seconds
            for k in keys:
                drafter = _drafter(k[0], k[1], stores=stores, indexes=indexes)
                r = replay(
                    drafter,
                    ids,
                    ref.output_token_ids,
                    max_nodes=opts.max_nodes,
                    max_new_tokens=opts.max_new_tokens,
                    max_positions=max_positions,
                )
                row = acc[_key(k)]
                row["tokens"] += r.new_tokens
                row["steps"] += r.steps
                row["draft"] += r.draft_seconds
                if i < opts.check and k[0] != "none" and k[1] is largest[k[0]]:
                    real = fixed.generate(
                        ids,
                        drafter=_drafter(k[0], k[1], stores=timing_stores, indexes=indexes),
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
                drafter = _drafter(k[0], k[1], stores=timing_stores, indexes=indexes)
                result = gens[_key(k)].generate(ids, drafter=drafter, max_new_tokens=opts.max_new_tokens)
                row = acc[_key(k)]
                row["real_tokens"] += result.new_tokens
                row["real_seconds"] += result.seconds
                row["real_steps"] += result.forward_passes
                row["exact"] += int(result.output_token_ids == ref.output_token_ids)
    finally:
        for handle in (*stores.values(), *timing_stores.values()):
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


def run_accept(
    opts: AcceptOptions,
    *,
    model: str,
    dsn: str,
    out: Path,
    argv: Sequence[str] = (),
    note: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Build the datastores, measure every drafter and size, write accept.json, accept.md and the plots."""
    from crest.bench.report import compare, write_markdown, write_plots
    from crest.bench.results import started_at, versions
    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import Tokenizer

    opts.validate()
    out.mkdir(parents=True, exist_ok=True)
    setting = opts.setting or "custom"
    started = time.time()
    corpus = prepare_corpus(opts, out)
    prompts, chat = prepare_prompts(opts, corpus)
    if not prompts:
        raise CorpusError("no prompts to run")
    need_rest = "rest" in opts.drafters or opts.top_t == ()
    rest = (
        build_rest_indexes(
            corpus,
            tokenizer=model,
            percents=opts.percents,
            out=out,
            seed=opts.seed,
            rebuild=opts.rebuild,
            setting=setting,
        )
        if need_rest
        else []
    )
    rest_for_rows = rest if "rest" in opts.drafters else []
    tops = list(opts.top_t) or auto_top_t(rest, max_n=opts.max_n)
    opts = replace(opts, top_t=tuple(tops))
    crest = []
    if any(d.startswith("crest") for d in opts.drafters):
        for t in tops:
            options = IngestOptions(max_n=opts.max_n, top_t=t, seed=opts.seed, suffix_rule=opts.suffix_rule)
            rule = "" if opts.suffix_rule == "lookup" else f"_{opts.suffix_rule}"
            crest.append(
                build_store(
                    corpus,
                    name=f"acc_{setting}_t{t}{rule}",
                    tokenizer=model,
                    dsn=dsn,
                    options=options,
                    out=out,
                    rebuild=opts.rebuild,
                )
            )
            counted = crest[-1]
            for keep in [k for k in opts.keep if k != "count"]:  # equal bytes: the count store's as the budget
                options = IngestOptions(max_n=opts.max_n, budget=counted.nbytes, keep=keep, seed=opts.seed)
                built = build_store(
                    corpus,
                    name=f"acc_{setting}_{keep}_t{t}",
                    tokenizer=model,
                    dsn=dsn,
                    options=options,
                    out=out,
                    rebuild=opts.rebuild,
                )
                crest.append(replace(built, top_t=t))
    note(f"datastores ready: {', '.join(v.name for v in (*rest, *crest))}")
    loaded = load_model(model, device=opts.device, dtype=opts.dtype)
    fingerprint = Tokenizer(loaded.tokenizer, loaded.spec).fingerprint  # the model's tokenizer, not loaded again
    prompt_ids = [loaded.encode_prompt(p, chat=chat) for p in prompts]
    measured = measure(
        opts,
        loaded=loaded,
        prompt_ids=prompt_ids,
        rest=rest_for_rows,
        crest=crest,
        dsn=dsn,
        fingerprint=fingerprint,
        out=out,
        note=note,
    )
    ablations = None
    if opts.ablations:
        ablations = ablate(
            opts,
            corpus,
            model=model,
            dsn=dsn,
            fingerprint=fingerprint,
            out=out,
            setting=setting,
            prompt_ids=prompt_ids,
            references=measured["references"],
            max_positions=int(getattr(loaded.model.config, "max_position_embeddings", 1 << 30)),
            note=note,
        )
    results = {
        "benchmark": "accept",
        "command": shlex.join(argv) if argv else None,
        "versions": versions(),
        "started_at": started_at(started),
        "setting": setting,
        "model": model,
        "options": {**asdict(opts), "chat": chat},
        "corpus": {
            "inputs": len(corpus.inputs),
            "format": corpus.fmt,
            "key": corpus.key,
            "heldout_conversations": opts.holdout if setting == "chat" and not opts.corpus else 0,
        },
        "prompts": len(prompts),
        "method": {
            "mean_accepted_length": f"replay of greedy verification on the plain greedy output, trees cut to "
            f"{opts.max_nodes} nodes (equals the real loop with --max-draft-tokens {opts.max_nodes}; see crosscheck)",
            "real": "real generation, adaptive draft size unless --max-draft-tokens; tokens/s and speedup over "
            "none in the same run",
        },
        "datastores": [asdict(v) for v in (*rest, *crest)],
        "rows": measured["rows"],
        "crosscheck": measured["crosscheck"],
        "comparison": compare(measured["rows"]),
        "ablations": ablations,
        "seconds": time.time() - started,
    }
    (out / "accept.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out / "accept.md")
    results["plots"] = write_plots(results, out)
    (out / "accept.json").write_text(json.dumps(results, indent=1))
    return results
