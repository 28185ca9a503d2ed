"""`crest serve` as real subprocesses: `tiny_serve_dir` (a fixture) is a directory holding a tiny random llama over
the SmolLM2 vocabulary and the SmolLM2 tokenizer, what `crest serve --model DIR` loads; `serve_processes` starts
several servers at once (each a `crest.bench.server_process.ServerProcess`: a free port, waited for on /health)
and stops them with SIGTERM; `refresh_counts` reads a server's live-refresh counters from its /metrics. Load it as
a plugin (`pytest_plugins`, with `tests.fix_corpus` for the tokenizer) for the fixture.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from crest.bench.server_process import ServerProcess
from tests.fix_models import tiny_model

START_TIMEOUT = 300.0  # seconds for a server to answer /health: two start at once on 2 busy cores
_REFRESH = re.compile(r'^crest_live_refresh_total\{result="(\w+)"\} ([0-9.e+]+)$', re.MULTILINE)


@pytest.fixture(scope="module")
def tiny_serve_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """A directory with a tiny random llama over the SmolLM2 vocabulary and the SmolLM2 tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-serve")
    tiny_model("llama", vocab=len(smollm2_tokenizer.hf), max_positions=2048).save_pretrained(str(directory))
    smollm2_tokenizer.hf.save_pretrained(str(directory))
    return directory


@contextmanager
def serve_processes(
    arg_lists: Sequence[Sequence[str]], *, timeout: float = START_TIMEOUT
) -> Iterator[list[ServerProcess]]:
    """Start one `crest serve ARGS` per argument list, all at once; yield them answering, SIGTERM them after."""
    servers = [ServerProcess(args, timeout=timeout) for args in arg_lists]
    with ThreadPoolExecutor(len(servers)) as pool:
        starts = [pool.submit(server.__enter__) for server in servers]
    failed = [str(f.exception()) for f in starts if f.exception() is not None]  # a failed start stopped itself
    try:
        if failed:
            pytest.fail(f"crest serve did not start: {failed[0]}")
        yield servers
    finally:
        for server, start in zip(servers, starts, strict=True):
            if start.exception() is None:
                server.__exit__(None, None, None)  # drains, then exits 0 (server.exit_code)


def refresh_counts(server: ServerProcess) -> dict[str, int]:
    """Return the server's live-tier refreshes by result (published, nothing, failed) from its /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {result: int(float(value)) for result, value in _REFRESH.findall(text)}
