"""`crest bench learn` and `crest bench learn-loop`: what learning from served outputs buys (registered by
`crest.cli.bench_commands`; the benchmarks themselves live in `crest.bench.learn` and `crest.bench.learn_loop`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from crest.cli.learn_commands import Window
from crest.cli.options import (
    Chat,
    Device,
    Dsn,
    Dtype,
    Json,
    MaxNewTokens,
    Model,
    StoreName,
)
from crest.config import DEFAULT_LEARN_WINDOW


def bench_learn_cmd(
    store: StoreName,
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for learn.json, learn.md and references.json.")],
    prompts: Annotated[str, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")] = (
        "humaneval"
    ),
    chat: Chat = False,
    model: Model = "smollm2",
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: MaxNewTokens = 128,
    max_nodes: Annotated[int, typer.Option(help="Draft tree size for the accepted-length replay.")] = 64,
    refresh_every: Annotated[
        int, typer.Option(help="Finished requests between live rebuilds (1: after every request).")
    ] = 1,
    window: Window = DEFAULT_LEARN_WINDOW,
    min_count: Annotated[int, typer.Option(help="Live trees for n-grams seen at least this often.")] = 2,
    references: Annotated[
        Path | None,
        typer.Option(help="Recorded greedy continuations (references.json of bench accept or learn) to reuse."),
    ] = None,
    rest: Annotated[
        list[str] | None,
        typer.Option(help="The static store's corpus (files, directories, globs; repeat): adds a REST row over it."),
    ] = None,
    calibrate: Annotated[
        bool, typer.Option(help="Size adaptive drafts with a measured cost model, not the pinned quiet-CPU one.")
    ] = False,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Serve a prompt stream in order, learning from each finished request: M by replay, static vs live vs both."""
    from crest.bench.learn import LearnOptions, run_learn
    from crest.cli.display import print_rows
    from crest.cli.store_commands import database

    options = LearnOptions(
        store=store,
        prompts=prompts,
        chat=chat,
        limit=limit,
        max_new_tokens=max_new_tokens,
        max_nodes=max_nodes,
        refresh_every=refresh_every,
        window=window,
        min_count=min_count,
        references=str(references) if references else None,
        rest=tuple(rest or ()),
        calibrate=calibrate,
        device=device,
        dtype=dtype,
    ).validate()
    results = run_learn(
        options, model=model, dsn=database(dsn), out=Path(out), note=lambda line: typer.echo(line, err=True)
    )
    if as_json:
        import json

        from crest.cli.display import json_value

        print(json.dumps(results, default=json_value), flush=True)
    else:
        print_rows(f"{results['prompts']} requests on {store!r}, learning in order (M by replay)", results["rows"])
        per_m = results["storage"]["bytes_per_million_tokens"]
        typer.echo(f"learned log: {per_m or 0:,} bytes per 1M served tokens")
    typer.echo(f"wrote {Path(out) / 'learn.json'}, {Path(out) / 'learn.md'}", err=True)


def bench_learn_loop_cmd(
    store: StoreName,
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for learn_loop.json, .md and the records.")],
    prompts: Annotated[str, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")] = (
        "humaneval"
    ),
    chat: Chat = False,
    model: Model = "smollm2",
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    max_new_tokens: MaxNewTokens = 128,
    refresh_every: Annotated[
        int, typer.Option(help="Finished requests between live rebuilds (1: after every request).")
    ] = 1,
    window: Window = DEFAULT_LEARN_WINDOW,
    min_count: Annotated[int, typer.Option(help="Live trees for n-grams seen at least this often.")] = 2,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the second pass.")] = 0.8,
    seed: Annotated[int, typer.Option(help="Seed of the second pass (prompt i samples with seed + i).")] = 0,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Serve prompts through the real loop with learning, timed against model.generate and HF's prompt lookup."""
    from crest.bench.learn_loop import LoopOptions, run_learn_loop
    from crest.cli.display import print_rows
    from crest.cli.store_commands import database

    options = LoopOptions(
        store=store,
        prompts=prompts,
        chat=chat,
        limit=limit,
        max_new_tokens=max_new_tokens,
        refresh_every=refresh_every,
        window=window,
        min_count=min_count,
        temperature=temperature,
        seed=seed,
        device=device,
        dtype=dtype,
    ).validate()
    results = run_learn_loop(
        options, model=model, dsn=database(dsn), out=Path(out), note=lambda line: typer.echo(line, err=True)
    )
    if as_json:
        import json

        from crest.cli.display import json_value

        print(json.dumps(results, default=json_value), flush=True)
    else:
        print_rows(f"{results['prompts']} requests on {store!r}, twice, through the real loop", results["rows"])
        h = results["headline"]
        typer.echo(
            f"learning: {h['learning_vs_generate']}x generate, {h['learning_vs_best_hf_lookup']}x {h['best_hf_lookup']}"
            f"; crest outputs differing from generate: {h['crest_mismatches']}"
        )
    typer.echo(f"wrote {Path(out) / 'learn_loop.json'}, {Path(out) / 'learn_loop.md'}", err=True)
