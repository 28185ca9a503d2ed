"""The vLLM proposer's log: crest's records through vLLM's handlers, and a periodic line on drafts and lookups.

vLLM sets handlers on its own logger only, so in its worker crest's INFO lines were lost and its warnings went to
Python's last-resort handler; `log_with_vllm` hands crest's and the SDK's loggers vLLM's handlers.

Every `every` seconds of steps (`CREST_REPORT_INTERVAL`, 60; 0: never), once steps stop (the proposer's idle
watcher: vLLM kills its worker without closing the proposer, so the last interval is said when traffic pauses)
and at close, `DraftReport` says the steps, draft tokens verified and accepted since its last line and since start
(vLLM's own counters, `vllm:spec_decode_num_draft_tokens` and `..._accepted_tokens`, are totals since start), the
chain tokens drafted and how many of them the cost curve kept (the rest did not pay for their verification), the
proposer's own time per step (p50 and p99, and per row at p50: what crest adds to a step) and, with a store, the
lookups it made, the SDK's cache hits, the lookups past their timeout and the failed ones (deltas of
`Store.stats`). A lookup past
its timeout (`CREST_LOOKUP_TIMEOUT`, 10 ms by default) drafts nothing from the store that step, which no other
figure tells apart from a context the store has no tree for: this line is where an operator of a vLLM server sees
that the database is too slow for the timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger("crest.integrations.vllm")

LOOKUP_COUNTS = ("lookups", "hits", "timeouts", "errors")  # the `Store.stats` keys said

FEED_COUNTS = ("feed_rows", "feed_notified")  # the learned feed's rows taken and wake-ups by a notification


def log_with_vllm() -> None:
    """Send crest's and the SDK's log records through vLLM's handlers, which vLLM sets on its own logger only.

    Without them a worker's root logger has no handler: INFO lines (the proposer's settings and figures) were lost
    and warnings went to Python's last-resort handler, unformatted. Nothing changes where crest's loggers already
    have handlers or vLLM's has none (vLLM's `VLLM_CONFIGURE_LOGGING=0`, or not inside vLLM).
    """
    theirs = logging.getLogger("vllm")
    for name in ("crest", "crest_client"):
        ours = logging.getLogger(name)
        if ours.handlers or not theirs.handlers:
            continue
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


class DraftReport:
    """Counts a proposer's steps, drafts and accepted tokens, and says them with its store's lookups now and then."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, int]] | None,
        *,
        every: float,
        costs: Callable[[], Sequence[tuple[int, float]]] | None = None,
        acceptance: Callable[[], Sequence[tuple[float, float, float]]] | None = None,
    ) -> None:
        """`stats`: the store's lookup and feed counters; `costs`: (tokens, seconds) of a step as the cost curve
        the proposer learned estimates them (empty before any step was sized); `acceptance`: (mean prediction,
        share accepted, decayed nodes) of each band of predicted probability (`AcceptanceCurve.bands`)."""
        self.stats, self.every, self.costs, self.acceptance = stats, every, costs, acceptance
        self.steps = self.drafted = self.accepted = self.rested = 0
        self.chosen = self.kept = 0  # chain tokens drafted, and kept by the cost curve, since the last line
        self.total_drafted = self.total_accepted = 0
        self.seconds: list[float] = []  # the proposer's own time of each step since the last line
        self.per_row: list[float] = []  # the same, per row of the step
        self.cpu: list[float] = []  # the proposer thread's CPU time of each step (no waiting for the database)
        self._since = time.monotonic()
        self._seen = dict(stats() if stats is not None else {})

    def verified(self, drafted: int, accepted: int) -> None:
        """Count a chain of `drafted` tokens that a step verified, `accepted` of them kept."""
        self.drafted += drafted
        self.accepted += accepted
        self.total_drafted += drafted
        self.total_accepted += accepted

    def sized(self, chosen: int, kept: int) -> None:
        """Count a step's chains: `chosen` tokens drafted, `kept` of them after the cost curve cut them to pay."""
        self.chosen += chosen
        self.kept += kept

    def step(self, *, seconds: float = 0.0, cpu: float = 0.0, rows: int = 1, rested: int = 0) -> None:
        """Count a step that took the proposer `seconds` (`cpu` of them on its CPU) for `rows` rows, `rested` of
        which went without a lookup that would not have paid; say the line when `every` seconds passed."""
        self.steps += 1
        self.rested += rested
        self.seconds.append(seconds)
        self.cpu.append(cpu)
        self.per_row.append(seconds / max(1, rows))
        self.say()

    def say(self, *, force: bool = False) -> str | None:
        """Log the line (when due, or `force`d) if any step ran since the last; return it."""
        now = time.monotonic()
        if self.every <= 0 or (not force and now - self._since < self.every):
            return None  # every <= 0: no lines
        stats = dict(self.stats() if self.stats is not None else {})
        line = None
        if self.steps:
            share = 100.0 * self.accepted / max(1, self.drafted)
            p50, p99 = (float(np.percentile(self.seconds, q)) * 1e3 for q in (50, 99))
            row = float(np.percentile(self.per_row, 50)) * 1e3
            cpu = float(np.percentile(self.cpu, 50)) * 1e3
            line = (
                f"crest proposer, last {now - self._since:.0f} s: {self.steps} steps, {self.drafted} draft tokens "
                f"verified, {self.accepted} accepted ({share:.0f}%); since start {self.total_drafted} verified, "
                f"{self.total_accepted} accepted; proposer time per step p50 {p50:.2f} ms, p99 {p99:.2f} ms "
                f"({row:.3f} ms per row; CPU p50 {cpu:.2f} ms); {self.rested} lookups rested (not worth their CPU); "
                f"{self.kept} of {self.chosen} chain tokens kept by the cost curve"
            )
            if self.stats is not None:
                d = {k: int(stats.get(k, 0)) - int(self._seen.get(k, 0)) for k in LOOKUP_COUNTS}
                line += (
                    f"; store lookups {d['lookups']} (cache hits {d['hits']}, past the timeout {d['timeouts']}, "
                    f"failed {d['errors']})"
                )
            learned = list(self.costs()) if self.costs is not None else []
            if learned:
                shown = " / ".join(f"{seconds * 1e3:.1f}" for _, seconds in learned)
                line += f"; a step of {' / '.join(str(t) for t, _ in learned)} tokens costs {shown} ms (learned)"
            bands = [b for b in (self.acceptance() if self.acceptance is not None else []) if b[2] >= 1.0]
            if bands:
                shown = " ".join(f"{p:.2f}:{a:.2f}" for p, a, _ in bands)
                line += f"; draft nodes predicted:accepted {shown} (learned)"
            if any(k in stats for k in FEED_COUNTS):
                f = {k: int(stats.get(k, 0)) - int(self._seen.get(k, 0)) for k in FEED_COUNTS}
                line += f"; other replicas' rows fed {f['feed_rows']} ({f['feed_notified']} notifications)"
            log.info(line)
        self.steps = self.drafted = self.accepted = self.rested = self.chosen = self.kept = 0
        self.seconds, self.per_row, self.cpu = [], [], []
        self._since, self._seen = now, stats
        return line
