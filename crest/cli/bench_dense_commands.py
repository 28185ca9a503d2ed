"""`crest bench dense`: dense drafting measured by replay, or the candidate indexes of a dense part side by side
(registered by `crest.cli.bench_commands`; the benchmarks live in `crest.bench.dense` and
`crest.bench.dense_lookup`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from crest.cli.options import Dsn, Model


def bench_dense_cmd(
    store: Annotated[
        str, typer.Option("--store", "-s", help="A store with a dense part (crest ingest --dense-model).")
    ],
    model: Model = "smollm2",
    prompts: Annotated[str, typer.Option(help="humaneval, or a JSONL file of prompts (prompt / turns[0] / text).")] = (
        "humaneval"
    ),
    limit: Annotated[int, typer.Option(help="First N prompts.")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt (the replayed continuation).")] = 128,
    max_nodes: Annotated[int, typer.Option(help="Draft tree size of the replay.")] = 64,
    drafters: Annotated[
        str | None, typer.Option(help="Comma-separated drafters to replay (default: crest's beside the dense kinds).")
    ] = None,
    indexes: Annotated[
        str | None,
        typer.Option(
            help="Measure only the batch lookup of these candidate indexes, side by side, e.g. "
            "ivfflat,hnsw:ef_search=40,ivfflat+halfvec:lists=100:probes=8 (KIND[+halfvec][:key=value]...)."
        ),
    ] = None,
    queries: Annotated[str, typer.Option(help="With --indexes: hidden (the model's states) or noisy.")] = "hidden",
    batch: Annotated[int, typer.Option(help="Contexts per batched lookup.")] = 16,
    rounds: Annotated[int, typer.Option(help="With --indexes: timed batches per index.")] = 200,
    dsn: Dsn = None,
) -> None:
    """M of the dense drafters beside crest's on the model's greedy continuations, and the batched dense lookup.

    Each prompt is decoded greedily once; each drafter is replayed on it with the same node budget, the dense parts
    fed the hidden state that predicted each context's last token. With --indexes, each candidate index is built
    on a copy of the store's dense part and timed side by side (latency, recall@k against exact search). Prints
    the figures as JSON.
    """
    if indexes:
        from crest.bench.dense_lookup import lookup_figures

        found = lookup_figures(
            store, dsn=dsn, variants=indexes.split(","), queries=queries, model=model, prompts=prompts, limit=limit,
            batch=batch, rounds=rounds,
        )  # fmt: skip
    else:
        from crest.bench.dense import DRAFTERS, compare

        found = compare(
            model,
            store=store,
            dsn=dsn,
            prompts=prompts,
            limit=limit,
            max_new_tokens=max_new_tokens,
            max_nodes=max_nodes,
            drafters=[d.strip() for d in drafters.split(",") if d.strip()] if drafters else DRAFTERS,
            batch=batch,
        )
    typer.echo(json.dumps(found, indent=2))
