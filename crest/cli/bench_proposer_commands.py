"""`crest bench proposer`: crest's vLLM proposer alone, driven as vLLM's runner drives it (registered by
`crest.cli.bench_commands`; the benchmark lives in `crest.bench.proposer`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from crest.cli.options import Dsn, StoreName, Tokenizer
from crest.config import DEFAULT_STAND_IN_FORWARD


def bench_proposer_cmd(
    store: StoreName,
    inputs: Annotated[
        str | None,
        typer.Option(
            help="Files (a glob) whose texts the requests follow (default: the standard library's "
            "subpackage modules, held out from the set-up's store of its top-level modules), or a JSONL file "
            '(gzipped or not) of crest answer\'s {"text": prompt + answer, "prompt": prompt} lines: each request '
            "reads the prompt and follows the answer (--prompt-tokens is not used)."
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help='--inputs is a JSONL file (gzipped or not) of chat-templated texts, {"text": prompt + answer} '
            "as crest answer --chat writes them: each request's prompt is a text through its assistant header, "
            "its output the answer (--prompt-tokens is not used).",
        ),
    ] = False,
    tokenizer: Tokenizer = "smollm2",
    limit: Annotated[int, typer.Option(help="Requests (files long enough, in name order).")] = 16,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens of each request's prompt.")] = 100,
    output_tokens: Annotated[int, typer.Option(help="Tokens of each request's output.")] = 128,
    k: Annotated[int, typer.Option("-k", help="num_speculative_tokens: the longest chain.")] = 8,
    concurrency: Annotated[int, typer.Option(help="Requests at once on the second pass.")] = 16,
    suffix: Annotated[
        bool,
        typer.Option(
            "--suffix",
            help="Also drive vLLM's `suffix` method through the same runner, side by side (needs arctic-inference: "
            "run crest from .ci/vllm-venv --with-suffix's python).",
        ),
    ] = False,
    forward_ms: Annotated[
        float,
        typer.Option(
            "--forward-ms",
            help="The target forward each step stands in for (a GPU's; no model runs): the proposer weighs each "
            "row's lookup CPU against the engine's tokens/s.",
        ),
    ] = DEFAULT_STAND_IN_FORWARD * 1e3,
    token_ms: Annotated[
        float,
        typer.Option(
            "--token-ms",
            help="What each draft token a forward verifies adds to it (0: flat, a GPU's shape at small batches; on "
            "this CPU about 4 ms at SmolLM2-135M).",
        ),
    ] = 0.0,
    dsn: Dsn = None,
) -> None:
    """M and the proposer's own time per step on two passes (first sight, again), recent tier off and on.

    Forgets what the store learned (its learned rows and live tier) before each configuration. Prints JSON rows.
    """
    from crest.bench.proposer import run_passes, run_suffix
    from crest.bench.proposer_requests import load_requests
    from crest.decoding.tokenizer import load_tokenizer

    for value, hint in ((forward_ms, "--forward-ms"), (token_ms, "--token-ms")):
        if not value >= 0:  # NaN too
            raise typer.BadParameter("must be >= 0", param_hint=hint)
    requests = load_requests(inputs, load_tokenizer(tokenizer).hf, chat=chat, limit=limit,
                             prompt_tokens=prompt_tokens, output_tokens=output_tokens)  # fmt: skip
    forward, token = forward_ms / 1e3, token_ms / 1e3
    found = run_passes(store, requests, dsn=dsn, k=k, concurrency=concurrency, forward=forward, token=token)
    found += run_suffix(requests, concurrency=concurrency, forward=forward, token=token) if suffix else []
    for figures in found:
        typer.echo(json.dumps(figures.row()))
