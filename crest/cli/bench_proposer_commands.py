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
            "subpackage modules, held out from the set-up's store of its top-level modules)."
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
    dsn: Dsn = None,
) -> None:
    """M and the proposer's own time per step on two passes (first sight, again), recent tier off and on.

    Forgets what the store learned (its learned rows and live tier) before each configuration. Prints JSON rows.
    """
    import glob
    import sysconfig

    from crest.bench.proposer import assistant_header, chat_requests, chat_texts, run_passes, run_suffix
    from crest.decoding.tokenizer import load_tokenizer

    pattern = inputs or sysconfig.get_path("stdlib") + "/*/*.py"
    encode = load_tokenizer(tokenizer).hf
    need = prompt_tokens + output_tokens
    requests: list[tuple[list[int], list[int]]] = []
    if chat:
        if inputs is None:
            raise typer.BadParameter("--chat needs --inputs FILE.jsonl (chat-templated texts)", param_hint="--inputs")
        header = assistant_header(encode)
        requests = chat_requests(chat_texts(inputs), lambda text: [int(t) for t in encode.encode(
            text, add_special_tokens=False)], header, limit=limit, output_tokens=output_tokens)  # fmt: skip
    for path in [] if chat else sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = [int(t) for t in encode.encode(f.read(), add_special_tokens=False)[:need]]
        if len(ids) == need:
            requests.append((ids[:prompt_tokens], ids[prompt_tokens:]))
        if len(requests) == limit:
            break
    if not requests:
        raise typer.BadParameter(f"no file of {pattern!r} holds {need} tokens", param_hint="--inputs")
    if forward_ms < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--forward-ms")
    found = run_passes(store, requests, dsn=dsn, k=k, concurrency=concurrency, forward=forward_ms / 1e3)
    found += run_suffix(requests, concurrency=concurrency, forward=forward_ms / 1e3) if suffix else []
    for figures in found:
        typer.echo(json.dumps(figures.row()))
