"""`crest generate`: check the options, open the generation (`crest.serving.generate`), print text or JSON lines."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from crest.cli.options import (
    Chat,
    Device,
    Dsn,
    Dtype,
    Json,
    MaxDraftTokens,
    MaxNewTokens,
    Model,
    OptionalStore,
    ReadDsn,
)
from crest.config import DEFAULT_DRAFTER


def generate(
    prompt: Annotated[str | None, typer.Argument(metavar="PROMPT", help="Prompt text (or use --prompts).")] = None,
    model: Model = "smollm2",
    store: OptionalStore = None,
    drafter: Annotated[
        str, typer.Option(envvar="CREST_DRAFTER", help="The drafter; `crest drafters` lists them.")
    ] = DEFAULT_DRAFTER,
    rest_index: Annotated[str | None, typer.Option(help="REST index directory for --drafter rest.")] = None,
    prompts: Annotated[str | None, typer.Option(help='JSONL file of {"prompt": ...} lines.')] = None,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k sampling (0 = off).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    chat: Chat = False,
    max_draft_tokens: MaxDraftTokens = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    as_json: Json = False,
    dsn: Dsn = None,
    read_dsn: ReadDsn = None,
) -> None:
    """Generate with tree-attention speculative decoding (greedy output equals plain decoding).

    Text streams to stdout and a line of figures goes to stderr; with --json, one JSON object per prompt.
    M (mean accepted length) is new tokens per target forward: 1.0 means no draft was verified.
    """
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
        read_dsn=read_dsn,
    )


def run_generate(
    *,
    prompt: str | None,
    prompts_file: str | None,
    model: str,
    store: str | None,
    drafter: str,
    rest_index: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    chat: bool,
    max_draft_tokens: int | None,
    stop: Sequence[str],
    device: str,
    dtype: str,
    as_json: bool,
    dsn: str | None,
    read_dsn: str | None = None,
) -> None:
    """Generate for one prompt or a file of prompts, printing text or JSON lines (each flushed)."""
    from crest.config import check_text
    from crest.decoding.sampling import check_sampling
    from crest.errors import ConfigError
    from crest.ingest.prompts import read_prompts
    from crest.serving.generate import open_generation

    if (prompt is None) == (prompts_file is None):
        raise ConfigError("give a PROMPT or --prompts FILE (one of them)")
    if max_new_tokens <= 0:
        raise ConfigError("--max-new-tokens must be positive")
    check_sampling(temperature=temperature, top_p=top_p, top_k=top_k)  # all before the model loads
    texts = [check_text(prompt, name="PROMPT")] if prompt is not None else list(read_prompts(str(prompts_file)))
    if not texts:
        raise ConfigError(f"no prompts in {prompts_file}")
    opened = open_generation(
        model,
        drafter=drafter,
        store=store,
        rest_index=rest_index,
        max_draft_tokens=max_draft_tokens,
        device=device,
        dtype=dtype,
        dsn=dsn,
        read_dsn=read_dsn,
        on_progress=_note,
    )
    with opened:
        for text in texts:
            sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop}
            on_text = None if as_json else _write_now
            result = opened.generate(text, chat=chat, max_new_tokens=max_new_tokens, on_text=on_text, **sampling)
            if as_json:
                payload = result.to_json()
                payload.pop("accepted_per_step", None)
                print(json.dumps(payload), flush=True)
            else:
                _note(
                    f"\n-- {result.new_tokens} tokens, {result.forward_passes} forwards, "
                    f"M = {result.mean_accepted_length:.2f}, {result.tokens_per_second:.1f} tokens/s"
                )


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
