"""`crest bench serve`: drive a crest server, or any OpenAI-compatible one, from many threads (registered by
`crest.cli.bench_commands`; the benchmark itself lives in `crest.bench.serve` and its report modules)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from crest.cli.bench_display import report_run
from crest.cli.options import Chat, Device, Dsn, Dtype, Json, MaxDraftTokens, Model, OptionalStore, Out


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
    from crest.bench.serve import check_levels, run_serve_bench
    from crest.bench.serve_report import append_comparisons, comparisons, write_plot
    from crest.bench.serve_texts import compare_to_reference, load_reference, save_texts
    from crest.drafters.registry import check_drafter
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts

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
    found = comparisons(results.rows)
    rows = [r.__dict__ for r in results.rows]
    title = f"crest serve on {prompts} ({model}, {max_tokens} greedy tokens, {len(texts)} requests per level)"
    extra: dict[str, Any] = {"prompts": prompts, "model": model, "store": store, "max_tokens": max_tokens}
    extra |= {"chat": chat, "url": url, "server_exit_code": results.server_exit_code, "comparisons": found}
    report_run("serve", rows, started=started, title=title, as_json=as_json, out=out, **extra)
    for figure in found:
        typer.echo(f"{figure['figure']}: {figure['value']}", err=True)
    if out is not None:
        typer.echo(f"wrote {save_texts(out, results.texts)}", err=True)
        append_comparisons(found, out / "serve.md")
        plot = write_plot(results.rows, out / "serve.png")
        if plot is not None:
            typer.echo(f"wrote {plot}", err=True)
