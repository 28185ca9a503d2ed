"""A TCP front for the test Postgres's unix socket that can be switched off (refusing) and on again, or stalled
(holding every byte, as a hung server or network would), and a listener that never answers (a database that
hangs): for tests of what a client does when the database fails.
"""

from __future__ import annotations

import contextlib
import glob
import socket
import threading

import psycopg


class Proxy:
    """A TCP front for the test Postgres's unix socket that can be switched off (refusing) and on again."""

    def __init__(self, socket_path: str) -> None:
        self.target = socket_path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.listener: socket.socket | None = None
        self.open: list[socket.socket] = []
        self.flowing = threading.Event()
        self.flowing.set()

    @classmethod
    def fronting(cls, dsn: str) -> tuple[Proxy, str]:
        """Return a proxy (down) for the unix-socket server of `dsn` and the DSN that reaches it through the proxy."""
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        proxy = cls(glob.glob(f"{info['host']}/.s.PGSQL.*")[0])
        return proxy, f"postgresql://{info['user']}@127.0.0.1:{proxy.port}/{info['dbname']}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for conn in self.open:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.open = []

    def stall(self) -> None:
        """Hold every byte either way (connections stay open, nothing arrives) until `resume`."""
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class Silent:
    """A listening TCP port that accepts connections and never answers: a database that hangs."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]

    def close(self) -> None:
        self.listener.close()
