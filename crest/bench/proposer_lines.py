"""The vLLM proposer's own time per step, read back from a vLLM server's log for `crest bench vllm`.

The proposer measures itself (`crest.integrations._report.DraftReport`): its INFO line says the steps since the
last line, its time per step (p50, p99), per row, and its CPU time per step (p50). vLLM calls no proposer after a
batch's last step, so the proposer says its last interval once steps have stopped for `IDLE_LEARN` seconds. A
benchmark that lets the proposer's periodic lines wait (`CREST_REPORT_INTERVAL` far beyond a pass) and then waits
for that line after each pass reads exactly that pass's figures.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(
    r"crest proposer, last \d+ s: (?P<steps>\d+) steps, .*?proposer time per step p50 (?P<p50>[\d.]+) ms, "
    r"p99 (?P<p99>[\d.]+) ms \((?P<row>[\d.]+) ms per row; CPU p50 (?P<cpu>[\d.]+) ms\)"
)

LINE_WAIT = 30.0  # seconds: the proposer says its line 5 s after the last step (more on a loaded machine)


@dataclass(frozen=True)
class ProposerTime:
    """One interval of the proposer's steps, as its INFO line says them (milliseconds)."""

    steps: int
    p50_ms: float
    p99_ms: float
    row_ms: float
    cpu_p50_ms: float


def parse_proposer_line(text: str) -> ProposerTime | None:
    """Return the figures of the last proposer line in `text`, or None when it holds none."""
    every = list(LINE.finditer(text))
    if not every:
        return None
    found = every[-1]
    return ProposerTime(int(found["steps"]), float(found["p50"]), float(found["p99"]), float(found["row"]),
                        float(found["cpu"]))  # fmt: skip


def log_size(log: Path) -> int:
    """Return how many bytes the log holds now (0 before it exists): where the next pass's lines begin."""
    return log.stat().st_size if log.exists() else 0


def wait_proposer_line(log: Path, *, after: int, timeout: float = LINE_WAIT) -> ProposerTime | None:
    """Return the proposer's first line written to `log` past byte `after`, waiting up to `timeout` s (None then)."""
    deadline = time.monotonic() + timeout
    while True:
        with log.open("rb") as handle:
            handle.seek(after)
            text = handle.read().decode("utf-8", errors="replace")
        match = LINE.search(text)
        if match is not None:
            return parse_proposer_line(match.group(0))
        if time.monotonic() > deadline:
            return None
        time.sleep(0.25)  # polling a log under a deadline
