"""`crest bench accept`: mean accepted length against datastore bytes, the main figure (registered by
`crest.cli.bench_commands`; the benchmark itself lives in `crest.bench.accept` and the modules it names)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from crest.cli.options import Chat, Device, Dsn, Dtype, MaxDraftTokens, MaxNewTokens, Model, SuffixJudge, SuffixRule
from crest.config import DEFAULT_DENSE_PRECISION, DEFAULT_SUFFIX_RULE


def bench_accept_cmd(
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for accept.json, accept.md, plots, REST indexes.")],
    setting: Annotated[
        str | None, typer.Option(help="Preset: chat (ShareGPT, MT-Bench + held-out) or code (stdlib, HumanEval).")
    ] = None,
    model: Model = "smollm2",
    corpus: Annotated[list[str] | None, typer.Option(help="Corpus input (repeatable), instead of a preset.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Format of --corpus.")] = "auto",
    add_corpus: Annotated[
        list[str] | None,
        typer.Option(help="A file added to the preset's (or --corpus) documents, read by its format (repeatable)."),
    ] = None,
    weight: Annotated[
        list[str] | None,
        typer.Option(metavar="INPUT=K", help="Read a --corpus or --add-corpus input K times (repeatable)."),
    ] = None,
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
    suffix_rule: SuffixRule = DEFAULT_SUFFIX_RULE,
    suffix_judge: SuffixJudge = None,
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
    dense_precision: Annotated[
        str, typer.Option(help="The dense parts' vectors: half (halfvec) or single (vector).")
    ] = DEFAULT_DENSE_PRECISION,
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
        add_corpus=tuple(add_corpus or ()),
        weight=tuple(weight or ()),
        fmt=fmt,
        prompts=prompts,
        chat=chat,
        drafters=tuple(d.strip() for d in drafters.split(",") if d.strip()),
        percents=tuple(float(v) for v in sizes.split(",") if v.strip()),
        top_t=_ints(top_t),
        keep=tuple(k.strip() for k in keep.split(",") if k.strip()),
        suffix_rule=suffix_rule,
        suffix_judge=tuple(suffix_judge or ()),
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
        dense_precision=dense_precision,
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
