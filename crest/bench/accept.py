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
replays on them without decoding again. Dense rows (`dense`, `crest+dense`, `crest+dense+prompt`) run on dense
datastores and hybrids (`crest.bench.accept_dense`), fed the hidden states of one plain forward per prompt. The
ablations (single n, n <= m) and the table of average tree sizes follow the paper's Figures 8-9 and Table 2
(`crest.bench.ablations`). Results go to `accept.json`, `accept.md` and PNG plots in the output folder.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from crest.bench import accept_dense
from crest.bench.ablations import ablate
from crest.bench.accept_measure import measure
from crest.bench.accept_options import AcceptOptions
from crest.bench.datastores import (
    Corpus,
    Variant,
    auto_top_t,
    build_rest_indexes,
    build_store,
    digest,
    hold_out,
    judge_key,
    mt_bench_path,
    sharegpt_path,
    size_tag,
    stdlib_files,
)
from crest.config import IngestOptions
from crest.errors import CorpusError
from crest.ingest.corpus import weigh_inputs

__all__ = ["AcceptOptions", "measure", "prepare_corpus", "prepare_prompts", "run_accept"]


def prepare_corpus(opts: AcceptOptions, out: Path) -> Corpus:
    """Return the run's corpus: a preset's (hold-out removed, written to `out`) or the given inputs, with the
    `--add-corpus` files after it and every `--weight` applied."""
    corpus = _base_corpus(opts, out)
    if not (opts.add_corpus or opts.weight):
        return corpus
    added = list(opts.add_corpus)
    inputs = weigh_inputs([*corpus.inputs, *added], opts.weight)
    key = digest([corpus.key, "added", *added, *map(size_tag, added), "weight", *opts.weight])
    return Corpus(inputs, "auto" if added else corpus.fmt, key, corpus.heldout_prompts)


def _base_corpus(opts: AcceptOptions, out: Path) -> Corpus:
    """Return a preset's corpus (hold-out removed, written to `out`) or the given inputs."""
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
    from crest.ingest.prompts import load_prompts

    if opts.prompts:
        prompts, chat = load_prompts(opts.prompts), opts.chat
    elif opts.setting == "code":
        prompts, chat = load_prompts("humaneval"), False
    else:
        prompts, chat = load_prompts(str(mt_bench_path(opts.mt_bench))) + corpus.heldout_prompts, True
    return (prompts[: opts.limit] if opts.limit else prompts), chat


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
    from crest.bench.report import compare, compare_dense, write_markdown, write_plots
    from crest.bench.results import started_at, versions
    from crest.decoding.models import load_model
    from crest.decoding.tokenizer import Tokenizer

    opts.validate()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    corpus = prepare_corpus(opts, out)
    setting = (opts.setting or "custom") + (f"_c{corpus.key[:6]}" if opts.add_corpus or opts.weight else "")
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
    crest, counted_stores = [], []
    if any(d.startswith("crest") for d in opts.drafters):
        for t in tops:
            options = IngestOptions(max_n=opts.max_n, top_t=t, seed=opts.seed, suffix_rule=opts.suffix_rule)
            rule = "" if opts.suffix_rule == "lookup" else f"_{opts.suffix_rule}"
            rule += f"_j{judge_key(opts.suffix_judge)}" if opts.suffix_judge else ""
            crest.append(
                build_store(
                    corpus,
                    name=f"acc_{setting}_t{t}{rule}",
                    tokenizer=model,
                    dsn=dsn,
                    options=options,
                    out=out,
                    rebuild=opts.rebuild,
                    judge=opts.suffix_judge,
                )
            )
            counted = crest[-1]
            counted_stores.append(counted)
            for keep in [k for k in opts.keep if k != "count"]:  # equal bytes: the count store's as the budget
                options = replace(options, top_t=None, budget=counted.nbytes, keep=keep)  # its suffix rule too
                built = build_store(
                    corpus,
                    name=f"acc_{setting}_{keep}_t{t}{rule}",
                    tokenizer=model,
                    dsn=dsn,
                    options=options,
                    out=out,
                    rebuild=opts.rebuild,
                    judge=opts.suffix_judge,
                )
                crest.append(replace(built, top_t=t))
    dense: list[Variant] = []
    if accept_dense.wants_dense(opts):
        counts = list(opts.dense_positions) or accept_dense.auto_positions(rest)
        opts = replace(opts, dense_positions=tuple(counts))
        dense = accept_dense.build_dense_stores(
            opts, corpus, positions=counts, model=model, dsn=dsn, out=out, setting=setting, note=note
        )
    hybrid = accept_dense.hybrids(counted_stores, dense, top_t=opts.dense_top_t)
    note(f"datastores ready: {', '.join(v.name for v in (*rest, *crest, *dense))}")
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
        dense=dense,
        hybrid=hybrid,
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
            "heldout_conversations": opts.holdout if opts.setting == "chat" and not opts.corpus else 0,
        },
        "prompts": len(prompts),
        "method": {
            "mean_accepted_length": f"replay of greedy verification on the plain greedy output, trees cut to "
            f"{opts.max_nodes} nodes (equals the real loop with --max-draft-tokens {opts.max_nodes}; see crosscheck)",
            "real": "real generation, adaptive draft size unless --max-draft-tokens; tokens/s and speedup over "
            "none in the same run",
        },
        "datastores": [asdict(v) for v in (*rest, *crest, *dense, *hybrid)],
        "rows": measured["rows"],
        "crosscheck": measured["crosscheck"],
        "comparison": compare(measured["rows"]),
        "dense_comparison": compare_dense(measured["rows"]),
        "ablations": ablations,
        "seconds": time.time() - started,
    }
    (out / "accept.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out / "accept.md")
    results["plots"] = write_plots(results, out)
    (out / "accept.json").write_text(json.dumps(results, indent=1))
    return results
