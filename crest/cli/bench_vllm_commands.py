"""`crest bench vllm`: vLLM's own drafting methods and crest's proposer side by side, one server after another
(registered by `crest.cli.bench_commands`; the benchmark itself lives in `crest.bench.vllm_compare`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from crest.cli.options import OptionalStore


def bench_vllm_cmd(
    model_dir: Annotated[Path, typer.Option(help="The model as a Hugging Face directory (crest export-hf).")],
    out: Annotated[Path, typer.Option(help="Folder for vllm.json, vllm.md and each server's log.")],
    store: OptionalStore = None,
    methods: Annotated[
        str, typer.Option(help="Comma-separated: none, ngram, suffix, crest+prompt-k8, crest+prompt-k16, prompt-k8.")
    ] = "none,ngram,suffix,crest+prompt-k8,crest+prompt-k16",
    workloads: Annotated[str, typer.Option(help="Comma-separated: humaneval, edit, chat, fleet, restart.")] = (
        "humaneval,edit,chat,fleet,restart"
    ),
    fleet_methods: Annotated[str, typer.Option(help="Methods run as a fleet of two one-core replicas.")] = (
        "suffix,crest+prompt-k8"
    ),
    limit: Annotated[int, typer.Option(help="Requests per workload.")] = 12,
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 128,
    concurrency: Annotated[int, typer.Option(help="Concurrency of pass B and of the second turns.")] = 8,
    cores: Annotated[str, typer.Option(help="Cores of a single server (taskset, VLLM_CPU_OMP_THREADS_BIND).")] = "0-1",
    chat_store: Annotated[
        str, typer.Option(help="The chat workload's store: reused when published, else ingested from --chat-corpus.")
    ] = "self_chat",
    chat_corpus: Annotated[
        Path, typer.Option(help="The model's own answers to chat prompts (crest answer --chat), JSONL, gzipped or not.")
    ] = Path("../shared/data/self_chat_smollm2.jsonl.gz"),
    chat_top_t: Annotated[int, typer.Option(help="--top-t of the chat store's ingest.")] = 100_000,
    mt_bench: Annotated[
        str | None, typer.Option(help="MT-Bench questions JSONL (default: ../shared/data/mt_bench_questions.jsonl).")
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(envvar="CREST_VLLM_PYTHON", help="A Python with vLLM (default: .ci/vllm-venv's)."),
    ] = None,
) -> None:
    """Measure vLLM none / ngram / suffix and crest's proposer on the same requests: tokens/s, M, TTFT, ITL, exactness.

    Each method gets its own server; pass A sends each request at concurrency 1 (first sight), pass B the same at
    --concurrency (seen once); the edit workload then sends second turns; the restart workload starts a new server
    and sends humaneval's requests once more (pass C, concurrency 1). The chat workload (MT-Bench first turns)
    runs on servers of its own, crest drafting from --chat-store, a store of the model's own answers to other
    questions (ingested from --chat-corpus on the first run). crest's learned rows are forgotten before each crest
    method. `suffix` needs arctic-inference (.ci/vllm-venv --with-suffix).
    """
    import sysconfig

    from crest.bench.datastores import mt_bench_path
    from crest.bench.vllm_compare import (
        Run,
        Workloads,
        markdown,
        run_chat,
        run_fleet,
        run_method,
        standard_methods,
        warmed_chat_store,
    )
    from crest.bench.vllm_workloads import chat_requests, edit_requests, humaneval_requests, stdlib_functions
    from crest.config import resolve_dsn
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts

    known = standard_methods(store)
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    fleet = [m.strip() for m in fleet_methods.split(",") if m.strip()]
    kinds = {w.strip() for w in workloads.split(",") if w.strip()}
    workload_names = {"humaneval", "edit", "chat", "fleet", "restart"}
    unknown = [m for m in chosen + fleet if m not in known] + sorted(kinds - workload_names)
    if unknown:
        raise ConfigError(f"unknown method or workload: {', '.join(unknown)} (methods: {', '.join(known)})")
    if limit < 2 or max_tokens < 1 or concurrency < 1:
        raise ConfigError("--limit must be 2 or more, --max-tokens and --concurrency positive")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model-dir {model_dir}: no config.json (write one with crest export-hf)")
    python = python or os.path.expanduser("~/.cache/crest/vllm-venv/bin/python")
    prompts = humaneval_requests(load_prompts("humaneval", limit=limit))
    stdlib = Path(sysconfig.get_path("stdlib"))
    work = Workloads(
        humaneval=prompts if kinds & {"humaneval", "fleet", "restart"} else [],
        edit=edit_requests(stdlib_functions(stdlib.glob("*.py"), count=limit)) if "edit" in kinds else [],
        fleet=prompts if "fleet" in kinds else [],
        chat=chat_requests(load_prompts(str(mt_bench_path(mt_bench)), limit=limit)) if "chat" in kinds else [],
        restart="restart" in kinds,
    )
    run = Run(
        python, str(model_dir), store, out, max_tokens=max_tokens, concurrency=concurrency, cores=cores,
        note=lambda line: typer.echo(line, err=True),
    )  # fmt: skip
    typer.echo(f"load average before: {os.getloadavg()}", err=True)
    if work.chat:
        if not chat_corpus.is_file():
            raise ConfigError(f"--chat-corpus {chat_corpus}: no such file (the chat workload's self corpus)")
        questions = load_prompts(str(mt_bench_path(mt_bench)))  # all of them: the store is reused with any --limit
        store_name = warmed_chat_store(chat_store, chat_corpus, tokenizer=str(model_dir), dsn=resolve_dsn(None),
                                  top_t=chat_top_t, leave_out=questions, note=run.note)  # fmt: skip
    for name in chosen:
        if work.humaneval or work.edit:
            run_method(run, known[name], work)
        if work.chat:
            run_chat(run, known[name], work.chat, store_name)
    if work.fleet:
        for name in fleet:
            run_fleet(run, known[name], work.fleet)
    table = markdown(run.rows)
    (out / "vllm.md").write_text(table + "\n", encoding="utf-8")
    typer.echo(table)
