"""`crest bench ceiling`: how far any choice among a context's stored suffixes could draft on the model's own text
(registered by `crest.cli.bench_commands`; the benchmark lives in `crest.bench.ceiling`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from crest.cli.options import Chat, Device, Dsn, Dtype, Json, MaxNewTokens, Model, Out


def bench_ceiling_cmd(
    store: Annotated[list[str], typer.Option("--store", "-s", help="Store to replay (repeatable).")],
    prompts: Annotated[str, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")],
    model: Model = "smollm2",
    chat: Chat = False,
    limit: Annotated[int | None, typer.Option(help="First N prompts only.")] = None,
    references: Annotated[
        Path | None,
        typer.Option(
            help="Folder whose references.json holds these prompts' plain greedy continuations (a `crest bench "
            "accept --out` folder, or an earlier run's): read when it matches model, prompts and length, else "
            "decoded and written there."
        ),
    ] = None,
    max_nodes: Annotated[int, typer.Option(help="Draft tree size of the replay.")] = 64,
    max_new_tokens: MaxNewTokens = 128,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    out: Out = None,
    dsn: Dsn = None,
) -> None:
    """Replay each store's longest and expected rules and the hindsight ceiling of its stored suffixes: M each.

    On the model's plain greedy continuations of the prompts, each step drafts from one stored suffix's tree:
    `longest` and `expected` as the SDK chooses (a store decided at ingest is read by its longest row under
    either), `ceiling` the tree that matches furthest, chosen with hindsight: no rule choosing one stored tree
    drafts more. `no_next`: the share of the ceiling's steps where no stored tree holds the model's next token
    (only the corpus can change that); `no_suffix`: where the context has no stored suffix at all.
    """
    from crest.bench.ceiling import ReferenceOptions, run_ceiling
    from crest.cli.bench_display import report_run
    from crest.cli.store_commands import database
    from crest.drafters.store import check_store
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts

    started = time.time()
    if max_nodes < 1 or max_new_tokens < 1 or (limit is not None and limit < 1):
        raise ConfigError("--max-nodes, --max-new-tokens and --limit must be at least 1")
    if references is not None and references.exists() and not references.is_dir():
        raise ConfigError(f"--references {str(references)!r} is not a folder")
    texts = load_prompts(prompts, limit=limit)
    if not texts:
        raise ConfigError(f"no prompts in {prompts!r}")
    url = database(dsn)
    for name in store:
        check_store(name, dsn=url)  # before the model loads
    options = ReferenceOptions(device=device, dtype=dtype, max_new_tokens=max_new_tokens)
    found = run_ceiling(
        store,
        texts,
        dsn=url,
        model=model,
        chat=chat,
        references=references,
        max_nodes=max_nodes,
        options=options,
        note=lambda line: typer.echo(line, err=True),
    )
    title = f"suffix ceiling on {prompts} ({model}, {max_nodes}-node trees, M = new tokens per step)"
    extra = {"prompts": prompts, "model": model, "max_nodes": max_nodes, "max_new_tokens": max_new_tokens}
    report_run("ceiling", [c.__dict__ for c in found], started=started, title=title, as_json=as_json, out=out, **extra)
