"""`crest export-hf`: write a model crest loads as a Hugging Face directory another engine (vLLM) can serve."""

from __future__ import annotations

from typing import Annotated

import typer

from crest.cli.options import Model


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
