"""`crest export-hf` and `crest export`: a model, or a store, in the form another engine (vLLM, llama.cpp) reads."""

from __future__ import annotations

from typing import Annotated

import typer

from crest.cli.options import Dsn, Json, Model, StoreName


def export_hf(
    out: Annotated[str, typer.Argument(metavar="DIR", help="Directory to write (new or empty, unless --force).")],
    model: Model = "smollm2",
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16 (vLLM on a CPU: float32).")] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Write into a directory that is not empty.")] = False,
) -> None:
    """Write the model as a Hugging Face directory (weights, config, tokenizer; no quantization config).

    A .gguf (or smollm2) is dequantized as crest loads it, so the engine serves the weights crest verifies with.
    """
    from crest.decoding.export import export_hf as write

    path = write(model, out, dtype=dtype, overwrite=force)
    typer.echo(f"wrote {model} to {path}", err=True)


def export(
    out: Annotated[str, typer.Argument(metavar="FILE", help="The file to write (replaced if it exists).")],
    store: StoreName,
    fmt: Annotated[str, typer.Option("--format", help="llama-lookup: a llama.cpp n-gram lookup cache.")] = (
        "llama-lookup"
    ),
    tier: Annotated[str, typer.Option(help="static, live, or all (their counts summed).")] = "static",
    gguf: Annotated[
        str | None, typer.Option(help="The model's .gguf: refuse unless the store was built with its tokenizer.")
    ] = None,
    as_json: Json = False,
    dsn: Dsn = None,
) -> None:
    """Write a store's n-grams (n <= 4) and next-token counts as a llama.cpp lookup cache.

    llama-server reads it with --spec-type ngram-cache --lookup-cache-static FILE (2-token keys) and/or
    --lookup-cache-dynamic FILE (1..4-token keys); so does the llama-lookup example (-lcs / -lcd). Token ids are
    the store's: build it with the model's GGUF tokenizer (--tokenizer model.gguf), which --gguf checks.
    """
    import dataclasses
    import json

    from crest.cli.store_commands import read_database
    from crest.errors import ConfigError
    from crest.integrations.llamacpp import export_llama_lookup

    if fmt != "llama-lookup":
        raise ConfigError(f"--format must be llama-lookup, not {fmt!r}")
    done = export_llama_lookup(read_database(dsn, store=store), store, out, tiers=tier, gguf=gguf)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(done)))
        return
    per_n = ", ".join(f"n={n}: {k}" for n, k in done.by_n.items())
    typer.echo(
        f"wrote {done.records} n-grams ({per_n}), {done.continuations} continuations, {done.bytes} bytes"
        f" from {store} ({'+'.join(done.tiers)}) to {done.path}"
    )
