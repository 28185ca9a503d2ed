"""`crest answer`: write the model's own greedy answers to prompts as a corpus (`crest.decoding.answers`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from crest.cli.options import Chat, Device, Dtype, Json, MaxNewTokens, Model


def answer(
    out: Annotated[Path, typer.Option("--out", "-o", help='JSONL file to write (one {"text": ...} per prompt).')],
    prompts: Annotated[
        str | None, typer.Option(help='humaneval, or a JSONL file of {"prompt": ...} (or turns, or text) lines.')
    ] = None,
    sharegpt: Annotated[
        str | None,
        typer.Option(help="A ShareGPT JSON array or JSONL file: answer seeded-random first human turns of it."),
    ] = None,
    skip: Annotated[int, typer.Option(help="Leave out the first N --prompts (the ones a benchmark measures).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Answer at most N prompts (--sharegpt: default 300).")] = None,
    answers_only: Annotated[
        bool,
        typer.Option("--answers-only", help="Write the answers alone, what the model writes (for --suffix-judge)."),
    ] = False,
    model: Model = "smollm2",
    chat: Chat = False,
    max_new_tokens: MaxNewTokens = 128,
    max_prompt_tokens: Annotated[int, typer.Option(help="Skip prompts longer than this (in tokens).")] = 512,
    batch: Annotated[int, typer.Option(help="Prompts generated together (left-padded; vLLM: at most at once).")] = 16,
    engine: Annotated[
        str, typer.Option(help="transformers, or vllm (where vLLM is installed: about 3x faster on this CPU).")
    ] = "transformers",
    seed: Annotated[int, typer.Option(help="Seed of the --sharegpt sample.")] = 0,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
) -> None:
    """Write the model's greedy answers to prompts as a corpus for crest ingest (the model's own text drafts best).

    Each line is {"text": prompt + answer} (the prompt as the model saw it, through the chat template with
    --chat), or with --answers-only the answer alone. Lines are written to OUT.partial as each batch finishes and
    OUT appears once every prompt is answered. A GPU answers thousands of prompts a minute; this 2-core CPU about 58
    tokens/s at --batch 64, and 3x that with --engine vllm (run from vLLM's environment).
    """
    from crest.decoding.answers import check_out, write_answers
    from crest.decoding.models import load_model
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts, sharegpt_turns

    if engine not in ("transformers", "vllm"):
        raise ConfigError(f"unknown --engine {engine!r}: use transformers or vllm")
    if (prompts is None) == (sharegpt is None):
        raise ConfigError("give --prompts or --sharegpt (one of them)")
    for name, value in (
        ("--max-new-tokens", max_new_tokens),
        ("--batch", batch),
        ("--max-prompt-tokens", max_prompt_tokens),
    ):
        if value < 1:
            raise ConfigError(f"{name} must be positive, got {value}")
    if skip < 0 or (limit is not None and limit < 1):
        raise ConfigError("--skip must be at least 0 and --limit positive")
    if sharegpt is not None:
        texts = sharegpt_turns(sharegpt, count=limit or 300, seed=seed)
    else:
        texts = load_prompts(str(prompts))[skip:][:limit]
    if not texts:
        raise ConfigError("no prompt to answer")
    check_out(out)  # before the model loads
    if engine == "vllm":
        from crest.integrations.vllm_answers import check_vllm

        check_vllm()
    loaded = load_model(model, device=device, dtype=dtype)
    generate = None
    if engine == "vllm":
        from functools import partial

        from crest.integrations.vllm_answers import vllm_responses

        generate = partial(vllm_responses, loaded, model=model, max_new_tokens=max_new_tokens, batch=batch, dtype=dtype)
    figures = write_answers(
        loaded,
        texts,
        out,
        chat=chat,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        batch=batch,
        answers_only=answers_only,
        generate=generate,
        note=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if as_json:
        print(json.dumps({"out": str(out), **figures}))
    else:
        print(
            f"wrote {figures['documents']} answers ({figures['new_tokens']:,} tokens, {figures['skipped']} prompts "
            f"skipped as too long) to {out} in {figures['seconds']:.0f} s"
        )
