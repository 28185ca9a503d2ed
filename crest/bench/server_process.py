"""`crest serve` in a subprocess for the benchmarks and tests that drive a real server: a free port, /health, SIGTERM.

`ServerProcess` starts `python -m crest.cli serve ARGS --host 127.0.0.1 --port PORT` on a port free now, waits
until `/health` answers (failing with the server's last log lines when it exits or the deadline passes), and
stops it with SIGTERM (drain, then exit 0), killing it after two minutes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from crest.errors import CrestError

SERVER_START_TIMEOUT = 900.0  # seconds: loading the model and a first calibration of its cost model


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`crest serve` in a subprocess on a free port: started, waited for (/health), stopped with SIGTERM."""

    def __init__(self, args: Sequence[str], *, timeout: float = SERVER_START_TIMEOUT) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.timeout = timeout
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (the server's stderr, closed in __exit__)
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> ServerProcess:
        import httpx

        command = [sys.executable, "-m", "crest.cli", *self.args]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)  # stdout: access log
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else f"gave no /health within {self.timeout:.0f} s"
                tail = self.tail()
                self.__exit__()
                raise CrestError(f"crest serve {why}: {tail}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: drain, then exit 0
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode if self.proc is not None else None
        self.log.close()

    def tail(self) -> str:
        """Return the last lines of the server's stderr, as one line."""
        self.log.seek(0)
        lines = [x.strip() for x in self.log.read().decode("utf-8", "replace").splitlines() if x.strip()]
        return " | ".join(lines[-3:]) or "no output"
