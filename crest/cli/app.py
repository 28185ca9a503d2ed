"""The `crest` command line: parses options (option > CREST_* environment variable > default) and calls the library.

Every failure the user can cause ends with a one-line message on stderr and a non-zero exit code, never a
traceback (set CREST_DEBUG=1 to see one).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n")[0])
db_app = typer.Typer(no_args_is_help=True, help="Manage the database schema.")
server_app = typer.Typer(no_args_is_help=True, help="Manage the embedded default PostgreSQL server.")
app.add_typer(db_app, name="db")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
rest_app = typer.Typer(no_args_is_help=True, help="The REST baseline's suffix-array index.")
app.add_typer(rest_app, name="rest-index")
app.add_typer(server_app, name="server")
app.add_typer(bench_app, name="bench")

Dsn = Annotated[
    str | None,
    typer.Option("--dsn", envvar="CREST_DATABASE_URL", help="PostgreSQL DSN; default: the embedded server."),
]
StoreName = Annotated[str, typer.Option("--store", "-s", envvar="CREST_STORE", help="Store name.")]
Out = Annotated[
    Path | None, typer.Option("--out", "-o", help="Also write <benchmark>.json and <benchmark>.md into this folder.")
]


@app.command()
def ingest(
    inputs: Annotated[list[str], typer.Argument(help="Files, directories or globs to read.")],
    store: StoreName,
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", "-t", envvar="CREST_TOKENIZER", help="HF tokenizer dir/name or .gguf file.")
    ],
    fmt: Annotated[str, typer.Option("--format", help="auto, sharegpt, jsonl or files.")] = "auto",
    max_n: Annotated[int, typer.Option(envvar="CREST_MAX_N", help="Largest n-gram length.")] = 4,
    top_t: Annotated[int | None, typer.Option(help="Keep the T most common n-grams of each n.")] = None,
    budget: Annotated[str | None, typer.Option(help="Largest T whose store fits this size, e.g. 200MB.")] = None,
    continuation_length: Annotated[int, typer.Option(help="Tokens of continuation per occurrence.")] = 10,
    max_matches: Annotated[int, typer.Option(help="Occurrences sampled per n-gram at most.")] = 5000,
    tree_size: Annotated[int, typer.Option(envvar="CREST_TREE_SIZE", help="Nodes kept per tree.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed of the occurrence sampling.")] = 0,
    selection: Annotated[str, typer.Option(help="combined (top-t of each n), single or upto.")] = "combined",
    single_n: Annotated[int | None, typer.Option(help="The n for --selection single.")] = None,
    blob_format: Annotated[
        int,
        typer.Option(envvar="CREST_BLOB_FORMAT", help="Tree blobs: 2 compact, 1 larger but faster to decode."),
    ] = 2,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
    chunk_tokens: Annotated[
        int, typer.Option(envvar="CREST_CHUNK_TOKENS", help="Corpus positions scanned at once (bounds peak memory).")
    ] = 1 << 22,
    dsn: Dsn = None,
) -> None:
    """Tokenize a corpus, keep its most common n-grams with their continuation trees, publish a store."""
    from crest.cli.display import RichReporter, print_summary
    from crest.config import IngestOptions, parse_size, resolve_dsn
    from crest.ingest.pipeline import ingest as run_ingest

    options = IngestOptions(
        max_n=max_n,
        top_t=top_t,
        budget=parse_size(budget) if budget is not None else None,
        continuation_length=continuation_length,
        max_matches=max_matches,
        tree_size=tree_size,
        seed=seed,
        selection=selection,
        single_n=single_n,
        blob_format=blob_format,
    ).validate()
    if options.top_t is None and options.budget is None:
        options = IngestOptions(**{**options.__dict__, "top_t": 100_000}).validate()
    with RichReporter(enabled=not quiet) as reporter:
        summary = run_ingest(
            inputs,
            store=store,
            tokenizer=tokenizer,
            dsn=resolve_dsn(dsn),
            options=options,
            fmt=fmt,
            reporter=reporter,
            chunk_tokens=chunk_tokens,
        )
    print_summary(summary)


@app.command()
def lookup(
    text: Annotated[str, typer.Argument(help="Text whose end is looked up.")],
    store: StoreName,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", "-t", help="Default: the tokenizer the store was built with.")
    ] = None,
    max_nodes: Annotated[int, typer.Option(help="Nodes of the tree to show.")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    dsn: Dsn = None,
) -> None:
    """Show the draft tree stored for the longest suffix of TEXT."""
    from crest_client import Store

    from crest.cli.display import print_draft
    from crest.config import check_store_name, resolve_dsn, resolve_model_spec
    from crest.ingest.tokenizer import load_tokenizer

    check_store_name(store)
    with Store.connect(resolve_dsn(dsn), store, cache_size=0, timeout=5.0) as handle:
        tok = load_tokenizer(resolve_model_spec(tokenizer or handle.info.tokenizer))
        if tok.fingerprint != handle.info.fingerprint:
            from crest.errors import FingerprintMismatch

            raise FingerprintMismatch(f"store {store!r} was built with another tokenizer than {tok.spec!r}")
        ids = tok.encode(text)
        draft = handle.draft(ids, max_nodes=max_nodes)
    pieces = [tok.hf.decode([int(t)]) for t in (draft.tokens.tolist() if draft is not None else [])]
    print_draft(draft, pieces, as_json=as_json)


@app.command()
def stores(
    show_all: Annotated[bool, typer.Option("--all", help="Also versions being built, retired or failed.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    dsn: Dsn = None,
) -> None:
    """List the stores with their figures and disk use."""
    from crest import db
    from crest.cli.display import print_stores
    from crest.config import resolve_dsn

    url = resolve_dsn(dsn)
    db.upgrade(url)
    with db.session(url) as conn:
        print_stores(db.list_stores(conn, include_all=show_all), as_json=as_json)


@app.command()
def drop(name: Annotated[str, typer.Argument(help="Store to drop.")], dsn: Dsn = None) -> None:
    """Drop the published version of a store."""
    from crest import db
    from crest.config import resolve_dsn

    url = resolve_dsn(dsn)
    with db.session(url) as conn:
        sid = db.drop_store(conn, name)
    typer.echo(f"dropped store {name!r} (version {sid})")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head", dsn: Dsn = None) -> None:
    """Create or migrate crest's tables (safe to run many times)."""
    from crest import db
    from crest.config import resolve_dsn

    current = db.upgrade(resolve_dsn(dsn), revision=revision)
    typer.echo(f"database schema at revision {current}")


@db_app.command("roles")
def db_roles(
    reader: Annotated[str, typer.Option(help="Read-only role for inference servers.")] = "crest_reader",
    writer: Annotated[str, typer.Option(help="Role that ingests (owns crest's tables).")] = "crest_writer",
    schema: Annotated[str, typer.Option(help="Schema holding crest's tables.")] = "public",
    reader_password_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the reader's password.")
    ] = None,
    writer_password_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the writer's password.")
    ] = None,
    dsn: Dsn = None,
) -> None:
    """Create or update a read-only role and a writer role with least privileges (safe to run many times)."""
    from crest.config import resolve_dsn
    from crest.db.roles import create_roles, password_from_env

    report = create_roles(
        resolve_dsn(dsn),
        reader=reader,
        writer=writer,
        schema=schema,
        reader_password=password_from_env(reader_password_env),
        writer_password=password_from_env(writer_password_env),
    )
    created = f" (created {', '.join(report.created)})" if report.created else ""
    typer.echo(
        f"reader {report.reader!r} may SELECT crest's {len(report.tables)} tables and later ones in schema "
        f"{report.schema!r}; writer {report.writer!r} owns them{created}"
    )


@server_app.command("start")
def server_start() -> None:
    """Start (or find) the embedded server and print its DSN."""
    from crest_client.embedded import embedded_dsn

    typer.echo(embedded_dsn())


@server_app.command("stop")
def server_stop() -> None:
    """Stop the embedded server."""
    from crest_client.embedded import stop_embedded

    typer.echo("stopped" if stop_embedded() else "not running")


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="Prompt text (or use --prompts).")] = None,
    model: Annotated[
        str, typer.Option("--model", "-m", envvar="CREST_MODEL", help="HF dir/name, .gguf or smollm2.")
    ] = "smollm2",
    store: Annotated[
        str | None, typer.Option("--store", "-s", envvar="CREST_STORE", help="Store for crest drafters.")
    ] = None,
    drafter: Annotated[str, typer.Option(help="none, prompt, rest, crest or crest+prompt.")] = "crest+prompt",
    rest_index: Annotated[str | None, typer.Option(help="REST index directory for --drafter rest.")] = None,
    prompts: Annotated[str | None, typer.Option(help='JSONL file of {"prompt": ...} lines.')] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k sampling (0 = off).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the model's chat template.")] = False,
    max_draft_tokens: Annotated[
        int | None, typer.Option(help="Fixed draft size (default: fitted to the hardware).")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    device: Annotated[str, typer.Option(envvar="CREST_DEVICE", help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, float16, bfloat16 or auto.")] = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt.")] = False,
    dsn: Dsn = None,
) -> None:
    """Generate with tree-attention speculative decoding (greedy output equals plain decoding)."""
    from crest.cli.generate import run_generate

    run_generate(
        prompt=prompt,
        prompts_file=prompts,
        model=model,
        store=store,
        drafter=drafter,
        rest_index=rest_index,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        chat=chat,
        max_draft_tokens=max_draft_tokens,
        stop=stop or [],
        device=device,
        dtype=dtype,
        as_json=as_json,
        dsn=dsn,
    )


@rest_app.command("build")
def rest_build(
    inputs: Annotated[list[str], typer.Argument(help="Files, directories or globs to read.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Index directory to write.")],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", "-t", envvar="CREST_TOKENIZER", help="Tokenizer.")
    ] = "smollm2",
    fmt: Annotated[str, typer.Option("--format", help="auto, sharegpt, jsonl or files.")] = "auto",
) -> None:
    """Build the REST baseline's suffix array over a corpus and report its size."""
    from crest.drafters.suffix_array import build_rest_index

    nbytes, tokens = build_rest_index(inputs, out=out, tokenizer=tokenizer, fmt=fmt)
    typer.echo(f"REST index of {tokens:,} tokens written to {out} ({nbytes:,} bytes)")


@bench_app.command("ingest")
def bench_ingest(
    inputs: Annotated[list[str], typer.Argument(help="Files, directories or globs to read.")],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", "-t", envvar="CREST_TOKENIZER", help="HF tokenizer dir/name or .gguf file.")
    ] = "smollm2",
    store: Annotated[str, typer.Option("--store", "-s", help="Store to build (replaced).")] = "bench_ingest",
    fmt: Annotated[str, typer.Option("--format", help="auto, sharegpt, jsonl or files.")] = "auto",
    max_n: Annotated[int, typer.Option(help="Largest n-gram length.")] = 4,
    top_t: Annotated[int, typer.Option(help="Keep the T most common n-grams of each n.")] = 100_000,
    tree_size: Annotated[int, typer.Option(help="Nodes kept per tree.")] = 64,
    blob_format: Annotated[int, typer.Option(help="Tree blobs: 2 compact, 1 faster to decode.")] = 2,
    keep: Annotated[bool, typer.Option("--keep/--drop", help="Keep the store afterwards.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    out: Out = None,
    dsn: Dsn = None,
) -> None:
    """Run a full ingest and print tokens/s per stage, peak memory and bytes per n-gram against the targets."""
    import time

    from crest import db
    from crest.bench.ingest import ingest_figures
    from crest.config import IngestOptions, resolve_dsn
    from crest.ingest.pipeline import ingest as run_ingest

    started = time.time()
    url = resolve_dsn(dsn)
    options = IngestOptions(max_n=max_n, top_t=top_t, tree_size=tree_size, blob_format=blob_format).validate()
    summary = run_ingest(inputs, store=store, tokenizer=tokenizer, dsn=url, options=options, fmt=fmt)
    if not keep:
        with db.session(url) as conn:
            db.drop_store(conn, store)
    title = f"ingest of {len(inputs)} input(s) into {store!r}"
    _report("ingest", [ingest_figures(summary)], started=started, title=title, as_json=as_json, out=out)


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
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    out: Out = None,
    dsn: Dsn = None,
) -> None:
    """Time draft() cache misses side by side with a bare prepared lookup, and cache hits; or, with --seconds, load."""
    import time

    from crest.bench.lookup import bench_load
    from crest.bench.lookup import bench_lookup as run
    from crest.config import check_store_name, resolve_dsn

    started = time.time()
    check_store_name(store)
    if seconds is not None:
        load = bench_load(
            resolve_dsn(dsn),
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
    figures = run(resolve_dsn(dsn), store, samples=samples, max_nodes=max_nodes)
    title = f"lookup latency on {store!r} (microseconds)"
    _report("lookup", [figures.__dict__], started=started, title=title, as_json=as_json, out=out, store=store)


@bench_app.command("generate")
def bench_generate_cmd(
    prompts: Annotated[
        str | None, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")
    ] = None,
    model: Annotated[str, typer.Option("--model", "-m", envvar="CREST_MODEL", help="Model.")] = "smollm2",
    store: Annotated[str | None, typer.Option("--store", "-s", help="Store for crest drafters.")] = None,
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] = "none,prompt,crest,crest+prompt",
    rest_index: Annotated[str | None, typer.Option(help="REST index directory for the rest drafter.")] = None,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 128,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the chat template.")] = False,
    max_draft_tokens: Annotated[int | None, typer.Option(help="Fixed draft size.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, float16, bfloat16.")] = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
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
    import time

    from crest.bench.generate import bench_generate, read_records, summarize_records
    from crest.bench.prompts import load_prompts
    from crest.errors import ConfigError

    started = time.time()
    if from_records is not None:
        rows = summarize_records(read_records(from_records))
        title = f"generation figures from {from_records}"
        _report("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out)
        return
    if prompts is None:
        raise ConfigError("give --prompts (humaneval or a JSONL file), or --from-records FILE")
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(_open_output(records)) if records else None
        rows = bench_generate(
            model=model,
            prompts=load_prompts(prompts, limit=limit),
            drafters=[d for d in drafters.split(",") if d],
            store=store,
            rest_index=rest_index,
            dsn=dsn,
            chat=chat,
            max_new_tokens=max_new_tokens,
            device=device,
            dtype=dtype,
            max_draft_tokens=max_draft_tokens,
            records=stream,
        )
    title = f"generation on {prompts} ({model}, {max_new_tokens} new tokens)"
    extra = {"prompts": prompts, "model": model, "store": store, "max_new_tokens": max_new_tokens, "chat": chat}
    _report("generate", [r.__dict__ for r in rows], started=started, title=title, as_json=as_json, out=out, **extra)


def _open_output(path: Path) -> Any:
    """Open a file to write, or raise a clear error."""
    from crest.errors import CrestError

    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise CrestError(f"cannot write {path}: {exc.strerror or exc}") from None


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
    """Print a benchmark's results (a table, or JSON) and write them into `out`, in the one results format."""
    import json

    from crest.bench.results import envelope, write_results
    from crest.cli.display import print_figures, print_rows

    results = envelope(benchmark, rows, started=started, **extra)
    if as_json:
        typer.echo(json.dumps(results, default=str))
    elif len(rows) == 1:
        print_figures(title, rows[0])
    else:
        print_rows(title, rows)
    for path in write_results(results, out, title=title) if out else []:
        typer.echo(f"wrote {path}", err=True)


def _ints(text: str | None) -> tuple[int, ...]:
    return tuple(int(float(v)) for v in (text or "").split(",") if v.strip())


@bench_app.command("accept")
def bench_accept_cmd(
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for accept.json, accept.md, plots, REST indexes.")],
    setting: Annotated[
        str | None, typer.Option(help="Preset: chat (ShareGPT, MT-Bench + held-out) or code (stdlib, HumanEval).")
    ] = None,
    model: Annotated[str, typer.Option("--model", "-m", envvar="CREST_MODEL", help="Model.")] = "smollm2",
    corpus: Annotated[list[str] | None, typer.Option(help="Corpus input (repeatable), instead of a preset.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Format of --corpus.")] = "auto",
    prompts: Annotated[str | None, typer.Option(help="humaneval or a JSONL file, instead of a preset.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the chat template (with --prompts).")] = False,
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] = "none,prompt,rest,crest,crest+prompt",
    sizes: Annotated[str, typer.Option(help="REST sizes: percentages of the documents.")] = "1,2,4,8,16,32,64,100",
    top_t: Annotated[str | None, typer.Option(help="crest top-t values (default: sized like REST's).")] = None,
    max_n: Annotated[int, typer.Option(help="crest stores' largest n.")] = 4,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 128,
    max_nodes: Annotated[int, typer.Option(help="Draft tree size for the accepted-length replay.")] = 64,
    holdout: Annotated[int, typer.Option(help="chat: conversations held out of every datastore.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of hold-out and document samples.")] = 0,
    timing: Annotated[str, typer.Option(help="Real generation for: all sizes, the largest, or none.")] = "largest",
    max_draft_tokens: Annotated[int | None, typer.Option(help="Fixed draft size when timing.")] = None,
    check: Annotated[int, typer.Option(help="Prompts whose replay is cross-checked by the real loop.")] = 1,
    ablations: Annotated[bool, typer.Option("--ablations", help="Single-n and n<=m curves, tree sizes.")] = False,
    ablation_top_t: Annotated[str | None, typer.Option(help="top-t values of the ablations.")] = None,
    ablation_limit: Annotated[int, typer.Option(help="Prompts of the ablations.")] = 20,
    mt_bench: Annotated[str | None, typer.Option(help="MT-Bench questions JSONL (chat).")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Rebuild datastores even when reusable.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, float16, bfloat16.")] = "float32",
    dsn: Dsn = None,
) -> None:
    """Mean accepted length against datastore bytes, crest vs REST, with tokens/s and the paper's ablations."""

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


def main() -> None:
    """Run the CLI, turning crest's errors into one-line messages and exit codes."""
    from crest_client.errors import CrestClientError

    try:
        app(standalone_mode=False)
    except CrestClientError as exc:
        _fail(str(exc), getattr(exc, "exit_code", 1))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except typer.Abort:
        _fail("aborted", 1)
    except Exception as exc:
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if os.environ.get("CREST_DEBUG"):
            raise
        _fail(f"unexpected {type(exc).__name__}: {exc} (set CREST_DEBUG=1 for a traceback)", 1)
    sys.exit(0)


def _fail(message: str, code: int) -> None:
    typer.echo(f"Error: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
