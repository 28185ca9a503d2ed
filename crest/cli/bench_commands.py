"""`crest bench ...` (benchmarks that print figures in one results format) and `crest rest-index build`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from crest.cli.bench_learn_commands import bench_learn_cmd, bench_learn_loop_cmd
from crest.cli.options import (
    Chat,
    Device,
    Dsn,
    Dtype,
    Format,
    Inputs,
    Json,
    MaxDraftTokens,
    MaxNewTokens,
    Model,
    OptionalStore,
    Out,
    ReadDsn,
    StoreName,
    SuffixRule,
    Tokenizer,
)
from crest.config import DEFAULT_TOP_T

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures (a table, or JSON with --json).")
bench_app.command("learn")(bench_learn_cmd)
bench_app.command("learn-loop")(bench_learn_loop_cmd)
rest_app = typer.Typer(no_args_is_help=True, help="The REST baseline's suffix-array index.")


@rest_app.command("build")
def rest_build(
    inputs: Inputs,
    out: Annotated[str, typer.Option("--out", "-o", help="Index directory to write.")],
    tokenizer: Tokenizer = "smollm2",
    fmt: Format = "auto",
) -> None:
    """Build the REST baseline's suffix array over a corpus and report its size."""
    from crest.drafters.suffix_array import build_rest_index

    nbytes, tokens = build_rest_index(inputs, out=out, tokenizer=tokenizer, fmt=fmt)
    typer.echo(f"REST index of {tokens:,} tokens written to {out} ({nbytes:,} bytes)")


@bench_app.command("ingest")
def bench_ingest(
    inputs: Inputs,
    tokenizer: Tokenizer = "smollm2",
    # no CREST_STORE here: this store is replaced, and dropped unless --keep
    store: Annotated[str, typer.Option("--store", "-s", help="Store to build (replaced).")] = "bench_ingest",
    fmt: Format = "auto",
    max_n: Annotated[int, typer.Option(help="Largest n-gram length.")] = 4,
    top_t: Annotated[int, typer.Option(help="Keep the T most common n-grams of each n.")] = DEFAULT_TOP_T,
    tree_size: Annotated[int, typer.Option(help="Nodes kept per tree.")] = 64,
    blob_format: Annotated[int, typer.Option(help="Tree blobs: 2 compact, 1 faster to decode.")] = 2,
    keep: Annotated[bool, typer.Option("--keep/--drop", help="Keep the store afterwards.")] = False,
    as_json: Json = False,
    out: Out = None,
    dsn: Dsn = None,
) -> None:
    """Run a full ingest and print tokens/s per stage, peak memory and bytes per n-gram against the targets."""
    from crest.bench.ingest import bench_ingest as run
    from crest.config import IngestOptions, resolve_dsn

    started = time.time()
    options = IngestOptions(max_n=max_n, top_t=top_t, tree_size=tree_size, blob_format=blob_format).validate()
    figures = run(inputs, store=store, tokenizer=tokenizer, dsn=resolve_dsn(dsn), options=options, fmt=fmt, keep=keep)
    title = f"ingest of {len(inputs)} input(s) into {store!r}"
    _report("ingest", [figures], started=started, title=title, as_json=as_json, out=out)


@bench_app.command("lookup")
def bench_lookup(
    store: StoreName,
    samples: Annotated[int, typer.Option(help="Contexts to look up.")] = 2000,
    max_nodes: Annotated[int, typer.Option(help="Tree nodes per draft.")] = 64,
    seconds: Annotated[
        float | None, typer.Option(help="Load mode: draft for this long from many threads and processes.")
    ] = None,
    concurrency: Annotated[int, typer.Option(help="Load mode: threads per process (one Store each).")] = 8,
    processes: Annotated[int, typer.Option(help="Load mode: processes.")] = 1,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Load mode: the SDK's LRU cache.")] = False,
    timeout: Annotated[float, typer.Option(help="Load mode: the SDK's per-lookup timeout in seconds.")] = 1.0,
    batch: Annotated[
        int | None, typer.Option(help="Batch mode: time draft_many() for batches of this many contexts.")
    ] = None,
    as_json: Json = False,
    out: Out = None,
    dsn: Dsn = None,
    read_dsn: ReadDsn = None,
) -> None:
    """Time draft() cache misses side by side with a bare prepared lookup, and cache hits; or, with --seconds, load."""
    from crest_client.hosts import check_dsn

    from crest.bench.lookup import bench_batch, bench_load
    from crest.bench.lookup import bench_lookup as run
    from crest.cli.store_commands import database
    from crest.config import check_store_name

    started = time.time()
    check_store_name(store)
    url = check_dsn(read_dsn) if read_dsn else database(dsn)  # a replica is migrated by its primary
    if batch is not None:
        batched = bench_batch(url, store, batch=batch, samples=samples, max_nodes=max_nodes)
        title = f"draft_many of {batch} contexts on {store!r} (cache misses)"
        _report("lookup-batch", [batched.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)
        return
    if seconds is not None:
        load = bench_load(
            url,
            store,
            concurrency=concurrency,
            processes=processes,
            seconds=seconds,
            samples=samples,
            max_nodes=max_nodes,
            cache=cache,
            timeout=timeout,
        )
        title = f"lookup load on {store!r} (latency in microseconds)"
        _report("lookup-load", [load.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)
        return
    figures = run(url, store, samples=samples, max_nodes=max_nodes)
    title = f"lookup latency on {store!r} (microseconds)"
    _report("lookup", [figures.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)


@bench_app.command("generate")
def bench_generate_cmd(
    prompts: Annotated[
        str | None, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")
    ] = None,
    model: Model = "smollm2",
    store: OptionalStore = None,
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] = "none,prompt,crest,crest+prompt",
    rest_index: Annotated[str | None, typer.Option(help="REST index directory for the rest drafter.")] = None,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: MaxNewTokens = 128,
    chat: Chat = False,
    max_draft_tokens: MaxDraftTokens = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    out: Out = None,
    records: Annotated[
        Path | None, typer.Option(help="Write one JSON line per prompt and drafter to this file as it goes.")
    ] = None,
    from_records: Annotated[
        Path | None, typer.Option(help="Only summarize a --records file (prompts every drafter finished).")
    ] = None,
    dsn: Dsn = None,
) -> None:
    """Compare drafters with model.generate side by side: M, tokens/s, speedup, draft latency, exactness."""
    import contextlib

    from crest.bench.generate import bench_generate, check_run, read_records, summarize_records
    from crest.bench.prompts import load_prompts
    from crest.bench.results import open_records
    from crest.drafters.registry import check_drafter
    from crest.errors import ConfigError

    started = time.time()
    if from_records is not None:
        rows = summarize_records(read_records(from_records))
        title = f"generation figures from {from_records}"
        _report("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out)
        return
    if prompts is None:
        raise ConfigError("give --prompts (humaneval or a JSONL file), or --from-records FILE")
    asked = [d for d in drafters.split(",") if d.strip()]
    names = [check_drafter(d, where="bench", store=store, rest_index=rest_index) for d in asked]
    prompt_texts = load_prompts(prompts, limit=limit)
    check_run(prompt_texts, max_new_tokens=max_new_tokens)
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(open_records(records)) if records else None
        rows = bench_generate(
            model=model,
            prompts=prompt_texts,
            drafters=names,
            store=store,
            rest_index=rest_index,
            dsn=dsn,
            chat=chat,
            max_new_tokens=max_new_tokens,
            device=device,
            dtype=dtype,
            max_draft_tokens=max_draft_tokens,
            records=stream,
            on_progress=lambda line: typer.echo(line, err=True),
        )
    title = f"generation on {prompts} ({model}, {max_new_tokens} new tokens)"
    extra = {"prompts": prompts, "model": model, "store": store, "max_new_tokens": max_new_tokens, "chat": chat}
    _report("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out, **extra)


@bench_app.command("serve")
def bench_serve_cmd(
    prompts: Annotated[str, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")],
    url: Annotated[
        str | None, typer.Option(help="A running crest server (http://HOST:PORT); default: start crest serve.")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="Comma-separated numbers of requests in flight.")] = "1,4,16",
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters (the request's drafter).")] = (
        "none,prompt,crest,crest+prompt"
    ),
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 128,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    chat: Chat = False,
    model: Model = "smollm2",
    store: OptionalStore = None,
    max_batch: Annotated[int | None, typer.Option(help="Started server's --max-batch (default: top level).")] = None,
    max_draft_tokens: MaxDraftTokens = None,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also the library generator, one prompt at a time.")
    ] = True,
    api_key: Annotated[str | None, typer.Option(envvar="CREST_API_KEY", help="The server's API key.")] = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    out: Out = None,
    dsn: Dsn = None,
    label: Annotated[
        str | None,
        typer.Option(help="Name the rows (one drafter, with --url): a server that drafts its own way, as vLLM."),
    ] = None,
    reference: Annotated[
        Path | None,
        typer.Option(
            help="An earlier run's --out folder (one drafter, e.g. vLLM without speculation): speedups and equal "
            "texts are counted against its rows at the same concurrency."
        ),
    ] = None,
) -> None:
    """Drive a crest server (or any OpenAI server, as vLLM) from many threads: tokens/s, TTFT, ITL, M."""
    from crest.bench.prompts import load_prompts
    from crest.bench.serve import check_levels, run_serve_bench
    from crest.bench.serve_report import append_targets, targets, write_plot
    from crest.bench.serve_texts import compare_to_reference, load_reference, save_texts
    from crest.drafters.registry import check_drafter
    from crest.errors import ConfigError

    started = time.time()
    levels = check_levels(concurrency)
    names = [check_drafter(d, where="serve", store=store) for d in drafters.split(",") if d.strip()]
    if not names:
        raise ConfigError(f"--drafters takes drafter names (`crest drafters` lists them); got {drafters!r}")
    if label is not None and (url is None or len(names) != 1 or not label.strip()):
        raise ConfigError("--label names the rows of one drafter against a server given by --url")
    if max_tokens < 1 or (limit is not None and limit < 1) or (max_batch is not None and max_batch < 1):
        raise ConfigError("--max-tokens, --limit and --max-batch must be positive")
    texts = load_prompts(prompts, limit=limit)
    if not texts:
        raise ConfigError(f"no prompts in {prompts!r}")
    compared = load_reference(reference) if reference is not None else None
    results = run_serve_bench(
        texts,
        url=url,
        drafters=names,
        levels=levels,
        max_tokens=max_tokens,
        chat=chat,
        model=model,
        store=store,
        max_batch=max_batch or max(levels),
        max_draft_tokens=max_draft_tokens,
        baseline=baseline,
        api_key=api_key,
        device=device,
        dtype=dtype,
        dsn=dsn,
        label=label,
        note=lambda line: typer.echo(line, err=True),
    )
    if compared is not None:
        compare_to_reference(results.rows, results.texts, compared)
    found = targets(results.rows)
    rows = [r.__dict__ for r in results.rows]
    title = f"crest serve on {prompts} ({model}, {max_tokens} greedy tokens, {len(texts)} requests per level)"
    extra: dict[str, Any] = {"prompts": prompts, "model": model, "store": store, "max_tokens": max_tokens}
    extra |= {"chat": chat, "url": url, "server_exit_code": results.server_exit_code, "targets": found}
    _report("serve", rows, started=started, title=title, as_json=as_json, out=out, **extra)
    for target in found:
        typer.echo(f"target {target['target']}: {target['value']} ({'met' if target['met'] else 'missed'})", err=True)
    if out is not None:
        typer.echo(f"wrote {save_texts(out, results.texts)}", err=True)
        append_targets(found, out / "serve.md")
        plot = write_plot(results.rows, out / "serve.png")
        if plot is not None:
            typer.echo(f"wrote {plot}", err=True)


@bench_app.command("accept")
def bench_accept_cmd(
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for accept.json, accept.md, plots, REST indexes.")],
    setting: Annotated[
        str | None, typer.Option(help="Preset: chat (ShareGPT, MT-Bench + held-out) or code (stdlib, HumanEval).")
    ] = None,
    model: Model = "smollm2",
    corpus: Annotated[list[str] | None, typer.Option(help="Corpus input (repeatable), instead of a preset.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Format of --corpus.")] = "auto",
    prompts: Annotated[str | None, typer.Option(help="humaneval or a JSONL file, instead of a preset.")] = None,
    chat: Chat = False,
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] = "none,prompt,rest,crest,crest+prompt",
    sizes: Annotated[str, typer.Option(help="REST sizes: percentages of the documents.")] = "1,2,4,8,16,32,64,100",
    top_t: Annotated[str | None, typer.Option(help="crest top-t values (default: sized like REST's).")] = None,
    keep: Annotated[
        str,
        typer.Option(
            "--keep",
            envvar="CREST_KEEP",
            help="Comma-separated n-gram keeping rules: count, savings, marginal (each non-count rule adds a store "
            "per top-t, built with the count store's bytes as its --budget).",
        ),
    ] = "count",
    suffix_rule: SuffixRule = "lookup",
    max_n: Annotated[int, typer.Option(help="crest stores' largest n.")] = 4,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: MaxNewTokens = 128,
    max_nodes: Annotated[int, typer.Option(help="Draft tree size for the accepted-length replay.")] = 64,
    holdout: Annotated[int, typer.Option(help="chat: conversations held out of every datastore.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of hold-out and document samples.")] = 0,
    timing: Annotated[str, typer.Option(help="Real generation for: all sizes, the largest, or none.")] = "largest",
    max_draft_tokens: MaxDraftTokens = None,
    check: Annotated[int, typer.Option(help="Prompts whose replay is cross-checked by the real loop.")] = 1,
    ablations: Annotated[bool, typer.Option("--ablations", help="Single-n and n<=m curves, tree sizes.")] = False,
    ablation_top_t: Annotated[str | None, typer.Option(help="top-t values of the ablations.")] = None,
    ablation_limit: Annotated[int, typer.Option(help="Prompts of the ablations.")] = 20,
    mt_bench: Annotated[str | None, typer.Option(help="MT-Bench questions JSONL (chat).")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Rebuild datastores even when reusable.")] = False,
    dense_positions: Annotated[
        str | None, typer.Option(help="Dense datastores: embedded positions of each (default: sized like REST's).")
    ] = None,
    dense_corpus: Annotated[
        list[str] | None, typer.Option(help="What the dense parts embed (repeatable; default: the run's corpus).")
    ] = None,
    dense_top_t: Annotated[int | None, typer.Option(help="The crest store the hybrids merge with.")] = None,
    dense_dims: Annotated[int, typer.Option(help="Dense vector dimensions (PCA).")] = 64,
    dense_continuation: Annotated[int, typer.Option(help="Tokens stored after each dense position.")] = 16,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    dsn: Dsn = None,
) -> None:
    """Mean accepted length against datastore bytes: REST, crest, dense and hybrids, with tokens/s and ablations."""
    from crest.bench.accept import AcceptOptions, run_accept
    from crest.bench.report import main_table
    from crest.config import resolve_dsn

    options = AcceptOptions(
        setting=setting,
        corpus=tuple(corpus or ()),
        fmt=fmt,
        prompts=prompts,
        chat=chat,
        drafters=tuple(d.strip() for d in drafters.split(",") if d.strip()),
        percents=tuple(float(v) for v in sizes.split(",") if v.strip()),
        top_t=_ints(top_t),
        keep=tuple(k.strip() for k in keep.split(",") if k.strip()),
        suffix_rule=suffix_rule,
        max_n=max_n,
        limit=limit,
        max_new_tokens=max_new_tokens,
        max_nodes=max_nodes,
        holdout=holdout,
        seed=seed,
        timing=timing,
        max_draft_tokens=max_draft_tokens,
        check=check,
        ablations=ablations,
        ablation_top_t=_ints(ablation_top_t),
        ablation_limit=ablation_limit,
        rebuild=rebuild,
        dense_positions=_ints(dense_positions),
        dense_corpus=tuple(dense_corpus or ()),
        dense_top_t=dense_top_t,
        dense_dims=dense_dims,
        dense_continuation=dense_continuation,
        mt_bench=mt_bench,
        device=device,
        dtype=dtype,
    ).validate()
    results = run_accept(
        options,
        model=model,
        dsn=resolve_dsn(dsn),
        out=Path(out),
        argv=["crest", *sys.argv[1:]],
        note=lambda line: typer.echo(line, err=True),
    )
    typer.echo("\n".join(main_table(results["rows"])))
    typer.echo(f"results: {Path(out) / 'accept.json'}, {Path(out) / 'accept.md'}, {len(results['plots'])} plot(s)")


def _ints(text: str | None) -> tuple[int, ...]:
    from crest.errors import ConfigError

    try:
        return tuple(int(float(v)) for v in (text or "").split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{text!r} is not a comma-separated list of numbers") from None


def _report(
    benchmark: str,
    rows: list[dict[str, Any]],
    *,
    started: float,
    title: str,
    as_json: bool,
    out: Path | None,
    **extra: Any,
) -> None:
    """Print a benchmark's results (a table, or one JSON line) and name the files they were written to."""
    import json

    from crest.bench.results import save_run
    from crest.cli.display import json_value, print_figures, print_rows

    results, paths = save_run(benchmark, rows, started=started, title=title, out=out, **extra)
    if as_json:
        print(json.dumps(results, default=json_value), flush=True)
    elif len(rows) == 1:
        print_figures(title, rows[0])
    else:
        print_rows(title, rows)
    for path in paths:
        typer.echo(f"wrote {path}", err=True)
