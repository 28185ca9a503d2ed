"""`crest bench vllm`: vLLM's own drafting (`none`, `ngram`, `suffix`) and crest's proposer, side by side in one run.

One vLLM server per method, one after another (`VllmServer`: vLLM's OpenAI server in a subprocess, optionally
pinned to cores with `taskset`). Against each, every workload runs its passes in order: pass A sends each request
once at concurrency 1 (first sight), pass B the same requests at concurrency 8 (both servers have seen them once);
the edit workload then sends its second turns; the restart workload starts a new server and sends humaneval's
requests once more at concurrency 1 (pass C: crest's recent tier is warmed from the learned log, `suffix`'s cache
starts empty). The chat workload (MT-Bench first turns) gets servers of its own,
whose crest proposers draft from a store warmed with the model's own answers to other questions (`warmed_chat_store`:
ingested from the self corpus once, then reused). crest learns into the shared database (`CREST_LEARN=1`) and what it
learned is forgotten (`crest forget`) before each crest method's server starts. The fleet runs two replicas, each
on one core, a client that sends each prompt to one replica and right after to the other, and restarts one replica
halfway. M (tokens per target forward) comes from vLLM's /metrics counters; exactness against `none`'s texts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from crest.bench.proposer_lines import ProposerTime, log_size, wait_proposer_line
from crest.bench.serve_figures import ServeFigures, Timed, serve_figures
from crest.bench.vllm_server import VllmServer, counters
from crest.bench.vllm_workloads import Request, fleet_schedule, same_texts, second_turns, self_corpus_lines

RESTART = "C (after a restart)"  # the humaneval pass of a new server: crest's database remembers, `suffix` starts empty

QUIET = "86400"  # CREST_REPORT_INTERVAL of crest's servers: only the line said once a pass's steps stop


@dataclass(frozen=True)
class Method:
    """One vLLM configuration: its speculative config (None: no speculation) and the environment crest reads."""

    name: str
    speculative: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def crest(self) -> bool:
        return bool(self.speculative and self.speculative.get("method") == "custom_class")


def standard_methods(store: str | None) -> dict[str, Method]:
    """Return the methods: none, ngram (K 4), suffix (its own adaptive length), crest K 8 / 16, crest `prompt` K 8."""

    def crest(k: int) -> Method:
        spec = {"method": "custom_class", "model": "crest.integrations.vllm.CrestProposer", "num_speculative_tokens": k}
        env = {"CREST_DRAFTER": "crest+prompt", "CREST_LEARN": "1", "CREST_REPORT_INTERVAL": QUIET}
        env |= {"CREST_STORE": store} if store else {}
        return Method(f"crest+prompt-k{k}", spec, env)

    prompt_only = {
        "method": "custom_class",
        "model": "crest.integrations.vllm.CrestProposer",
        "num_speculative_tokens": 8,
    }
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    found = [Method("none"), Method("ngram", ngram), Method("suffix", {"method": "suffix"}), crest(8), crest(16)]
    found.append(Method("prompt-k8", prompt_only, {"CREST_DRAFTER": "prompt", "CREST_LEARN": "0",
                                                   "CREST_REPORT_INTERVAL": QUIET}))  # fmt: skip
    return {m.name: m for m in found}


def send(url: str, request: Request, *, max_tokens: int) -> Timed:
    """Send one greedy streamed request (a completion, or a chat) and time its chunks."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600.0)
    common: dict[str, Any] = dict(
        model="smollm2", max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    started = time.perf_counter()
    if request.chat:
        messages = [{"role": role, "content": content} for role, content in request.messages]
        stream: Any = client.chat.completions.create(messages=messages, **common)  # type: ignore[arg-type]
    else:
        stream = client.completions.create(prompt=request.prompt, **common)
    pieces, chunks, tokens = [], [], 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = int(chunk.usage.completion_tokens)
        if chunk.choices:
            piece = (chunk.choices[0].delta.content if request.chat else chunk.choices[0].text) or ""
            if piece:
                chunks.append(time.perf_counter())
                pieces.append(piece)
    return Timed("".join(pieces), tokens, 0, started, chunks)


@dataclass
class PassRow:
    """One pass of one workload against one method: the serving figures, drafts and exactness."""

    method: str
    workload: str
    label: str  # A (first sight, concurrency 1), B (again, concurrency 8), turn 2, fleet phases
    figures: ServeFigures
    drafted: float
    accepted: float
    same_as_none: int | None = None
    load: float = 0.0  # the 1-minute load average when the pass ended
    prompts: int = 0  # distinct prompts (a fleet serves each twice; exactness counts each prompt's first text)
    proposer: ProposerTime | None = None  # crest's proposer's own time per step in the pass (a fleet: the slower)


PassFound = tuple[ServeFigures, list[str | None], float, float, ProposerTime | None]


def run_pass(
    servers: Sequence[VllmServer],
    schedule: Sequence[Sequence[tuple[int, int]]],
    requests: Sequence[Request],
    *,
    max_tokens: int,
) -> PassFound:
    """Send each worker's (request, server) list in order, the workers at once; return figures, texts, drafts and,
    for crest's servers, the proposer's own time per step in the pass (the slowest server's).

    M counts each request's target forwards as its tokens less the draft tokens vLLM accepted (over all servers).
    """
    urls = [server.url for server in servers]
    logs = [log_size(server.log) for server in servers]
    before = [counters(u) for u in urls]
    texts: list[str | None] = [None] * len(requests)
    done: list[Timed] = []

    def work(items: Sequence[tuple[int, int]]) -> None:
        for index, server in items:
            timed = send(urls[server], requests[index], max_tokens=max_tokens)
            done.append(timed)
            texts[index] = texts[index] if texts[index] is not None else timed.text

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(schedule)) as pool:
        list(pool.map(work, schedule))
    wall = time.perf_counter() - started
    after = [counters(u) for u in urls]
    accepted = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    drafted = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    share = accepted / max(1, sum(d.tokens for d in done))
    for d in done:
        d.forwards = max(1, round(d.tokens * (1.0 - share)))
    figures = serve_figures(done, mode="server", drafter="", concurrency=len(schedule), wall=wall)
    proposer = None
    if servers[0].method.crest:  # the proposer says the pass's line once its steps stop
        said = [wait_proposer_line(server.log, after=at) for server, at in zip(servers, logs, strict=True)]
        proposer = max((t for t in said if t is not None), key=lambda t: t.p50_ms, default=None)
    return figures, texts, drafted, accepted, proposer


def spread(count: int, concurrency: int) -> list[list[tuple[int, int]]]:
    """Return `count` requests on server 0 split among `concurrency` workers in round-robin order."""
    return [[(i, 0) for i in range(w, count, concurrency)] for w in range(min(concurrency, count))]


@dataclass
class Workloads:
    """The requests of each workload (the edit workload's second turns are built from its first answers)."""

    humaneval: list[Request]
    edit: list[Request]
    fleet: list[Request]
    chat: list[Request] = field(default_factory=list)
    restart: bool = False  # after humaneval's passes, a new server sends its requests once more at concurrency 1


@dataclass
class Run:
    """Everything a `crest bench vllm` run needs to start servers and send requests."""

    python: str
    model_dir: str
    store: str | None
    out: Path
    max_tokens: int = 128
    concurrency: int = 8
    cores: str = "0-1"
    note: Callable[[str], None] = lambda _: None
    rows: list[PassRow] = field(default_factory=list)
    reference: dict[tuple[str, str], list[str | None]] = field(default_factory=dict)  # none's texts per pass
    texts: dict[str, list[str | None]] = field(default_factory=dict)  # every pass's texts, "method/workload/label"

    def record(
        self, method: Method, workload: str, label: str, found: Any, *, reference: list[str | None] | None = None
    ) -> list[str | None]:
        """Keep a pass's row (exactness against `none`'s texts of the pass, or `reference`) and return its texts."""
        figures, texts, drafted, accepted, proposer = found
        figures.drafter = method.name
        if method.name == "none":
            self.reference[workload, label] = texts
        same = same_texts(texts, self.reference.get((workload, label), reference))
        row = PassRow(method.name, workload, label, figures, drafted, accepted, same, os.getloadavg()[0], len(texts),
                      proposer)  # fmt: skip
        self.rows.append(row)
        self.texts[f"{method.name}/{workload}/{label}"] = texts
        self.note(
            f"{method.name} {workload} {label}: {figures.output_tokens_per_second:.1f} tokens/s, "
            f"M = {figures.mean_accepted_length:.2f}, same as none {same}, load {row.load:.1f}"
        )
        self.save()
        return texts

    def save(self) -> None:
        """Write the rows so far to `out/vllm.json` and every pass's texts to `out/texts.json`."""
        self.out.mkdir(parents=True, exist_ok=True)
        rows = [asdict(r) for r in self.rows]
        (self.out / "vllm.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        (self.out / "texts.json").write_text(json.dumps(self.texts, indent=1) + "\n", encoding="utf-8")

    def server(self, method: Method, *, cores: str | None = None, tag: str = "") -> VllmServer:
        """Return (not yet started) a server for this method, its log in the run's folder."""
        log = self.out / f"server-{method.name}{tag}.log"
        return VllmServer(self.python, self.model_dir, method, cores=cores or self.cores, log=log, extra_env={})

    def forget(self, method: Method) -> None:
        """Delete what crest learned in the method's store, so it starts from the static tier alone."""
        store = method.env.get("CREST_STORE")
        if method.crest and store:
            command = [sys.executable, "-m", "crest.cli", "forget", "--store", store, "--yes"]
            subprocess.run(command, check=True, capture_output=True)


def run_method(run: Run, method: Method, workloads: Workloads) -> None:
    """Start one server for the method and run the humaneval and edit workloads' passes against it."""
    run.forget(method)
    run.note(f"starting vLLM: {method.name}")
    with run.server(method) as server:
        servers, c, n = [server], run.concurrency, run.max_tokens
        send(server.url, Request(prompt="def warm_up():"), max_tokens=4)
        for name, requests in (("humaneval", workloads.humaneval), ("edit", workloads.edit)):
            if not requests:
                continue
            first = run.record(method, name, "A", run_pass(servers, spread(len(requests), 1), requests, max_tokens=n))
            run.record(method, name, "B", run_pass(servers, spread(len(requests), c), requests, max_tokens=n))
            if name == "edit":
                answers = run.reference.get((name, "A"), first)
                turns = second_turns(requests, answers)
                run.record(method, name, "turn 2", run_pass(servers, spread(len(turns), c), turns, max_tokens=n))
    if workloads.restart and workloads.humaneval:  # what a method kept of the prompts it served, once restarted
        requests = workloads.humaneval
        run.note(f"restarting vLLM: {method.name}")
        with run.server(method, tag="-restart") as server:
            send(server.url, Request(prompt="def warm_up():"), max_tokens=4)
            found = run_pass([server], spread(len(requests), 1), requests, max_tokens=run.max_tokens)
            run.record(method, "humaneval", RESTART, found)


def run_chat(run: Run, method: Method, requests: Sequence[Request], store: str) -> None:
    """Start one server for the method (crest drafting from the warmed chat `store`) and run the chat passes."""
    if "crest" in method.env.get("CREST_DRAFTER", ""):  # the store drafters: the warmed store
        method = dataclasses.replace(method, env=method.env | {"CREST_STORE": store})
    run.forget(method)
    run.note(f"starting vLLM for chat: {method.name}")
    with run.server(method, tag="-chat") as server:
        servers, n = [server], run.max_tokens
        send(server.url, Request(messages=(("user", "Hi"),)), max_tokens=4)
        run.record(method, "chat", "A", run_pass(servers, spread(len(requests), 1), requests, max_tokens=n))
        run.record(
            method, "chat", "B", run_pass(servers, spread(len(requests), run.concurrency), requests, max_tokens=n)
        )


def warmed_chat_store(
    name: str,
    corpus: Path,
    *,
    tokenizer: str,
    dsn: str,
    top_t: int,
    leave_out: Sequence[str],
    note: Callable[[str], None],
) -> str:
    """Return store `name`: reused when published, else ingested from the self corpus (without `leave_out`'s records).

    The corpus is a JSONL of chat-templated prompts and the model's answers (`crest answer --chat`), gzipped or not.
    """
    import tempfile

    from crest import db
    from crest.config import IngestOptions
    from crest.ingest.pipeline import ingest
    from crest.learning.live import published_version

    with db.session(dsn) as conn:
        found = published_version(conn, name, "static")
    if found is not None:
        note(f"chat store {name!r}: reused (version {found['id']}; crest drop {name} to build it again)")
        return name
    note(f"chat store {name!r}: ingesting {corpus} (top-t {top_t}, a few minutes)")
    with tempfile.TemporaryDirectory(prefix="crest-self-") as work:
        plain = Path(work) / "self_corpus.jsonl"
        with plain.open("w", encoding="utf-8") as sink:
            sink.writelines(self_corpus_lines(corpus, leave_out=leave_out))
        ingest([str(plain)], store=name, tokenizer=tokenizer, dsn=dsn, options=IngestOptions(top_t=top_t), fmt="jsonl")
    return name


def run_fleet(run: Run, method: Method, requests: Sequence[Request]) -> None:
    """Two replicas on one core each; each prompt served by one, then the other; replica 1 restarted halfway.

    Phase 1 sends the first half of the prompts; phase 2, after the restart, every prompt (the first half again,
    which only the database remembers on the restarted replica, and the second half for the first time).
    """
    run.forget(method)
    run.note(f"starting two vLLM replicas: {method.name}")
    half = len(requests) // 2
    first, second = run.server(method, cores="0", tag="-r0"), run.server(method, cores="1", tag="-r1")
    with first, second:
        for server in (first, second):
            send(server.url, Request(prompt="def warm_up():"), max_tokens=4)
        servers, n = [first, second], run.max_tokens
        plain = run.reference.get(("humaneval", "A"))  # the fleet sends the humaneval prompts: none's texts
        found = run_pass(servers, fleet_schedule(half), requests[:half], max_tokens=n)
        run.record(method, "fleet", "phase 1", found, reference=plain[:half] if plain else None)
        second.__exit__()
        run.note(f"restarting replica 1: {method.name}")
        restarted = run.server(method, cores="1", tag="-r1b")
        with restarted:
            send(restarted.url, Request(prompt="def warm_up():"), max_tokens=4)
            servers = [first, restarted]
            found = run_pass(servers, fleet_schedule(len(requests)), requests, max_tokens=n)
            run.record(method, "fleet", "phase 2 (after restart)", found, reference=plain)


def markdown(rows: Sequence[PassRow]) -> str:
    """Return the rows as one markdown table per workload."""
    lines: list[str] = []
    for workload in dict.fromkeys(r.workload for r in rows):
        lines += [f"**{workload}**", ""]
        head = ["method", "pass", "c", "tokens/s", "M", "accepted / drafted", "TTFT p50 (ms)", "ITL p50 (ms)"]
        head += ["proposer ms/step p50 / p99 (CPU p50)", "same as none", "load"]
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in rows:
            if r.workload != workload:
                continue
            f = r.figures
            same = "-" if r.same_as_none is None else f"{r.same_as_none}/{r.prompts or f.requests}"
            t = r.proposer
            own = "-" if t is None else f"{t.p50_ms:.2f} / {t.p99_ms:.2f} ({t.cpu_p50_ms:.2f})"
            lines.append(
                f"| {r.method} | {r.label} | {f.concurrency} | {f.output_tokens_per_second:.1f} | "
                f"{f.mean_accepted_length:.2f} | {r.accepted:.0f} / {r.drafted:.0f} | {f.ttft_ms_p50:.0f} | "
                f"{f.itl_ms_p50:.1f} | {own} | {same} | {r.load:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)
