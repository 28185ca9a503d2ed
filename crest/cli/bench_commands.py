"""`crest bench ...` (benchmarks that print figures in one results format) and `crest rest-index build`.

The `bench` group's own commands here are ingest, lookup and generate; learn and learn-loop
(`crest.cli.bench_learn_commands`), serve (`crest.cli.bench_serve_commands`), accept
(`crest.cli.bench_accept_commands`), ceiling (`crest.cli.bench_ceiling_commands`), dense
(`crest.cli.bench_dense_commands`) and vllm (`crest.cli.bench_vllm_commands`) live in modules of their own
and are registered here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from crest.cli.bench_accept_commands import bench_accept_cmd
from crest.cli.bench_ceiling_commands import bench_ceiling_cmd
from crest.cli.bench_dense_commands import bench_dense_cmd
from crest.cli.bench_display import report_run
from crest.cli.bench_learn_commands import bench_learn_cmd, bench_learn_loop_cmd
from crest.cli.bench_proposer_commands import bench_proposer_cmd
from crest.cli.bench_serve_commands import bench_serve_cmd
from crest.cli.bench_vllm_commands import bench_vllm_cmd
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
    """Run a full ingest and print tokens/s per stage, peak memory and bytes per n-gram."""
    from crest.bench.ingest import bench_ingest as run
    from crest.config import IngestOptions, resolve_dsn

    started = time.time()
    options = IngestOptions(max_n=max_n, top_t=top_t, tree_size=tree_size, blob_format=blob_format).validate()
    figures = run(inputs, store=store, tokenizer=tokenizer, dsn=resolve_dsn(dsn), options=options, fmt=fmt, keep=keep)
    title = f"ingest of {len(inputs)} input(s) into {store!r}"
    report_run("ingest", [figures], started=started, title=title, as_json=as_json, out=out)


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

    from crest.bench.lookup import bench_lookup as run
    from crest.bench.lookup_batch import bench_batch
    from crest.bench.lookup_load import bench_load
    from crest.cli.store_commands import database
    from crest.config import check_store_name

    started = time.time()
    check_store_name(store)
    url = check_dsn(read_dsn) if read_dsn else database(dsn)  # a replica is migrated by its primary
    if batch is not None:
        batched = bench_batch(url, store, batch=batch, samples=samples, max_nodes=max_nodes)
        title = f"draft_many of {batch} contexts on {store!r} (cache misses)"
        report_run(
            "lookup-batch", [batched.__dict__], started=started, title=title, as_json=as_json, out=out, store=store
        )
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
        report_run("lookup-load", [load.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)
        return
    figures = run(url, store, samples=samples, max_nodes=max_nodes)
    title = f"lookup latency on {store!r} (microseconds)"
    report_run("lookup", [figures.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)


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
    from crest.bench.results import open_records
    from crest.drafters.registry import check_drafter
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts

    started = time.time()
    if from_records is not None:
        rows = summarize_records(read_records(from_records))
        title = f"generation figures from {from_records}"
        report_run("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out)
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
    report_run("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out, **extra)


bench_app.command("serve")(bench_serve_cmd)  # registered after generate: `crest bench --help` lists them in this order
bench_app.command("accept")(bench_accept_cmd)
bench_app.command("proposer")(bench_proposer_cmd)
bench_app.command("ceiling")(bench_ceiling_cmd)
bench_app.command("dense")(bench_dense_cmd)
bench_app.command("vllm")(bench_vllm_cmd)
