"""The learning tier in tests: the static corpus and ingest options the learning tests share, the rows of a
version, the published version of each tier, and a `crest refresh` subprocess paused at a fault stage (with a
wait until the killed refresh's advisory locks are gone).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from crest.config import IngestOptions
from crest.db.versions import refresh_lock_key

OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=4)
STATIC_TEXT = ["the cat sat on the mat", "a dog sat on a mat"]


def version_rows(dsn: str, store_id: int) -> set[tuple[int, bytes, int, bytes]]:
    """Return a version's rows as (n, key, count, tree blob)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT n, key, count, tree FROM crest_ngrams WHERE store_id = %s", (store_id,)).fetchall()
    return {(int(n), bytes(k), int(c), bytes(t)) for n, k, c, t in rows}


def published(dsn: str, store: str) -> dict[str, int]:
    """Return {tier: id} of the store's published versions."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tier, id FROM crest_stores WHERE name = %s AND state = 'published'", (store,)
        ).fetchall()
    return {str(t): int(i) for t, i in rows}


def start_paused_refresh(dsn: str, home: Path, stage: str) -> subprocess.Popen[str]:
    """Start `crest refresh --store words` that pauses at `stage`; return it once it says so."""
    env = {**os.environ, "CREST_DATABASE_URL": dsn, "CREST_HOME": str(home), "CREST_FAULT_PAUSE": stage}
    args = [sys.executable, "-m", "crest.cli", "refresh", "--store", "words"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    stderr = proc.stderr
    assert stderr is not None

    def pump() -> None:
        with stderr:  # closed once the process is gone (killed by the test)
            for line in stderr:
                lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline, said = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        try:
            said.append(lines.get(timeout=0.5))
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if said[-1].strip() == f"crest-fault-pause {stage}":
            return proc
    proc.kill()
    proc.wait()
    pytest.fail(f"refresh never reached stage {stage!r}: {''.join(said)[-2000:]}")


def wait_until_unlocked(dsn: str) -> None:
    """Wait until no session holds a build's or a refresh's advisory lock (the server saw the kill)."""
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = ANY(%s)",
                ([0x4352, refresh_lock_key("words")[0]],),
            ).fetchone()
            if row == (0,):
                return
            time.sleep(0.05)
    pytest.fail("the killed refresh's session still holds its locks")
