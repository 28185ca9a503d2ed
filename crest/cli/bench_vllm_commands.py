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
        str, typer.Option(help="Comma-separated: none, ngram, suffix, crest+prompt-k8, crest+prompt-k16.")
    ] = "none,ngram,suffix,crest+prompt-k8,crest+prompt-k16",
    workloads: Annotated[str, typer.Option(help="Comma-separated: humaneval, edit, fleet.")] = "humaneval,edit,fleet",
    fleet_methods: Annotated[str, typer.Option(help="Methods run as a fleet of two one-core replicas.")] = (
        "suffix,crest+prompt-k8"
    ),
    limit: Annotated[int, typer.Option(help="Requests per workload.")] = 12,
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 128,
    concurrency: Annotated[int, typer.Option(help="Concurrency of pass B and of the second turns.")] = 8,
    cores: Annotated[str, typer.Option(help="Cores of a single server (taskset, VLLM_CPU_OMP_THREADS_BIND).")] = "0-1",
    python: Annotated[
        str | None,
        typer.Option(envvar="CREST_VLLM_PYTHON", help="A Python with vLLM (default: .ci/vllm-venv's)."),
    ] = None,
) -> None:
    """Measure vLLM none / ngram / suffix and crest's proposer on the same requests: tokens/s, M, TTFT, ITL, exactness.

    Each method gets its own server; pass A sends each request at concurrency 1 (first sight), pass B the same at
    --concurrency (seen once); the edit workload then sends second turns. crest's learned rows are forgotten before
    each crest method. `suffix` needs arctic-inference (.ci/vllm-venv --with-suffix).
    """
    import sysconfig

    from crest.bench.vllm_compare import Run, Workloads, markdown, run_fleet, run_method, standard_methods
    from crest.bench.vllm_workloads import edit_requests, humaneval_requests, stdlib_functions
    from crest.errors import ConfigError
    from crest.ingest.prompts import load_prompts

    known = standard_methods(store)
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    fleet = [m.strip() for m in fleet_methods.split(",") if m.strip()]
    kinds = {w.strip() for w in workloads.split(",") if w.strip()}
    unknown = [m for m in chosen + fleet if m not in known] + sorted(kinds - {"humaneval", "edit", "fleet"})
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
        humaneval=prompts if "humaneval" in kinds or "fleet" in kinds else [],
        edit=edit_requests(stdlib_functions(stdlib.glob("*.py"), count=limit)) if "edit" in kinds else [],
        fleet=prompts if "fleet" in kinds else [],
    )
    run = Run(
        python, str(model_dir), store, out, max_tokens=max_tokens, concurrency=concurrency, cores=cores,
        note=lambda line: typer.echo(line, err=True),
    )  # fmt: skip
    typer.echo(f"load average before: {os.getloadavg()}", err=True)
    for name in chosen:
        run_method(run, known[name], work)
    if work.fleet:
        for name in fleet:
            run_fleet(run, known[name], work.fleet)
    table = markdown(run.rows)
    (out / "vllm.md").write_text(table + "\n", encoding="utf-8")
    typer.echo(table)
