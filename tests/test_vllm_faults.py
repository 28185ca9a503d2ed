"""crest inside a real vLLM when its database fails (slow): a PostgreSQL killed in the middle of a batch costs
drafts only, and once it is back the store's drafts are accepted again and vLLM's requests are learned again.

One vLLM without speculation gives the greedy references and stops. One vLLM with `CrestProposer` then serves from
a store of those texts in a private PostgreSQL the test kills (`OwnServer`; the session's server is other
tests' too), with drafter `crest` and neither the recent tier nor the live refresh, so every draft comes from the
store's database. The fixture bounds its own waits (pytest-timeout counts the test function only).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from tests.fix_db import OwnServer
from tests.fix_vllm import REQUEST_TIMEOUT, K, VllmServer, required_vllm_python

KILLED = [  # the batch running when PostgreSQL is killed
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "def is_prime(n):",
    "# Sort a list of numbers\ndef bubble_sort(items):",
]
KILLED_TOKENS = 128  # long enough to outlast the kill
RESUMED = [  # sent once it is back: prose, so no lookup the killed batch made (and the SDK cached) drafts for them
    "The history of the Roman Empire",
    "Dear hiring manager,",
    "Photosynthesis is the process",
]
RESUMED_TOKENS = 48
RESUMED_ACCEPTED = 20  # store draft tokens the resumed requests must get accepted (about 90 when all goes well)


@pytest.fixture(scope="module")
def killable() -> Iterator[OwnServer]:
    server = OwnServer(prefix="crest-vllm-pg-")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def served(killable: OwnServer, tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Any:
    """vLLM's greedy texts without speculation, then a vLLM drafting with CrestProposer (drafter crest) from a store
    of those texts in the killable PostgreSQL."""
    from crest.decoding.export import export_hf

    python = required_vllm_python()
    root = tmp_path_factory.mktemp("vllm-faults")
    model = export_hf("smollm2", root / "smollm2")
    plain = VllmServer(python, model, root / "plain.log", spec=None, env={})
    try:
        plain.wait_ready()
        with ThreadPoolExecutor(2) as pool:  # one batch
            killed = pool.submit(plain.complete, KILLED, max_tokens=KILLED_TOKENS)
            resumed = pool.submit(plain.complete, RESUMED, max_tokens=RESUMED_TOKENS)
            refs = SimpleNamespace(killed=killed.result(), resumed=resumed.result())
    finally:
        plain.stop()
    prompts, texts = KILLED + RESUMED, refs.killed + refs.resumed
    records = [json.dumps({"text": p + t}) for p, t in zip(prompts, texts, strict=True)]
    corpus = root / "taught.jsonl"
    corpus.write_text("\n".join(records * 5) + "\n", encoding="utf-8")
    options = IngestOptions(top_t=5000)
    ingest([str(corpus)], store="taught", tokenizer=str(smollm2_gguf), dsn=killable.dsn, options=options)
    env = {"CREST_STORE": "taught", "CREST_DRAFTER": "crest", "CREST_LEARN": "1", "CREST_RECENT": "0"}
    env |= {"CREST_REFRESH_INTERVAL": "0", "CREST_DATABASE_URL": killable.dsn, "CREST_READ_DATABASE_URL": killable.dsn}
    # lookups on a loaded machine can outrun the 10 ms default and draft nothing (see test_vllm.served); with the
    # database down every step waits this long, so not much longer
    env |= {"CREST_LOOKUP_TIMEOUT": "0.2", "CREST_REPORT_INTERVAL": "1"}
    spec = {"method": "custom_class", "model": "crest.integrations.vllm.CrestProposer", "num_speculative_tokens": K}
    server = VllmServer(python, model, root / "crest.log", spec=spec, env=env)
    try:
        server.wait_ready()
        yield SimpleNamespace(server=server, refs=refs, db=killable)
    finally:
        server.stop()


def accepted(server: VllmServer) -> float:
    return server.counters().get("accepted_tokens_total", 0.0)


@pytest.mark.slow
def test_vllm_serves_on_through_a_postgres_killed_mid_batch_and_drafts_again_once_it_is_back(served: Any) -> None:
    server, db, refs = served.server, served.db, served.refs
    before = accepted(server)
    with ThreadPoolExecutor(len(KILLED)) as pool:
        batch = [pool.submit(server.complete, [prompt], max_tokens=KILLED_TOKENS) for prompt in KILLED]
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while accepted(server) <= before:  # the batch is drafting from the store
            assert not any(f.done() for f in batch), "a request finished before any draft was accepted"
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.05)  # polling a condition under a deadline
        db.stop()  # killed, as a crash would
        running = sum(not f.done() for f in batch)
        texts = [f.result(timeout=REQUEST_TIMEOUT)[0] for f in batch]
    assert running > 0, "the batch finished before the database was killed"
    assert texts == refs.killed  # greedy: vLLM's own texts, drafts or none
    db.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while True:  # requests sent after the restart get the store's drafts (it reconnects within a few seconds)
        start = accepted(server)
        assert server.complete(RESUMED, max_tokens=RESUMED_TOKENS) == refs.resumed
        if (gained := accepted(server) - start) >= RESUMED_ACCEPTED:
            break
        assert time.monotonic() < deadline, f"{gained} accepted since the database came back:\n{server.tail(60)}"
    rows = 0
    while rows < len(RESUMED):  # and they are learned: the learner writes to the database again
        with psycopg.connect(db.dsn) as conn:
            found = conn.execute("SELECT count(*) FROM crest_learned WHERE new_tokens = %s", [RESUMED_TOKENS])
            rows = int(found.fetchone()[0])  # type: ignore[index]
        assert time.monotonic() < deadline, f"{rows} resumed requests learned:\n{server.tail(60)}"
        time.sleep(0.2)  # polling a condition under a deadline
    log = server.log.read_text(errors="replace")
    assert server.proc.poll() is None and "Traceback" not in log and "crest proposer failed" not in log
    print(f"killed with {running} of {len(KILLED)} requests running; {gained:.0f} accepted after the restart")
