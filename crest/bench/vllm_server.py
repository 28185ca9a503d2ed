"""A vLLM OpenAI server in a subprocess for `crest bench vllm`, and its speculative-decoding counters.

The server runs on a free port, optionally pinned to cores with `taskset` (and vLLM's OpenMP threads bound to
them), its output appended to a log; it is ready once /health answers, and stopped with its process group (vLLM's
engine core is a child process of the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from crest.bench.server_process import free_port
from crest.errors import CrestError

VLLM_START_TIMEOUT = 600.0  # seconds: vLLM's CPU start with -O0 under load


class VllmServer:
    """vLLM's OpenAI server in a subprocess on a free port (optionally `taskset` to `cores`), waited for on /health."""

    def __init__(
        self, python: str, model_dir: str, method: Any, *, cores: str, log: Path, extra_env: dict[str, str]
    ) -> None:
        self.python, self.model_dir, self.method, self.cores, self.log = python, model_dir, method, cores, log
        self.extra_env = extra_env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """Return the command line that starts this server."""
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        args += ["--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048", "-O0"]
        args += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.method.speculative is not None:
            args += ["--speculative-config", json.dumps(self.method.speculative)]
        return ["taskset", "-c", self.cores, *args]

    def __enter__(self) -> VllmServer:
        import httpx

        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": self.cores}
        env |= self.method.env | self.extra_env
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as handle:
            self.proc = subprocess.Popen(
                self.command(), stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + VLLM_START_TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise CrestError(f"vLLM ({self.method.name}) did not start: see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # vLLM's engine core is a child process of the server
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def counters(url: str) -> tuple[float, float]:
    """Return vLLM's accepted and drafted speculative tokens so far (0, 0 without speculation)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    sums = {"vllm:spec_decode_num_accepted_tokens_total": 0.0, "vllm:spec_decode_num_draft_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums["vllm:spec_decode_num_accepted_tokens_total"], sums["vllm:spec_decode_num_draft_tokens_total"]
