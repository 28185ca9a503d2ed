"""The proposer's rows and their chains: the hot path of a vLLM step, which must cost well under a GPU step.

A row (one request) keeps its drafter, its tokens and a `ChainStream`, the rest of the last best chain it drafted.
Each step, every row that drafts gets its chain the cheapest way that is as good as a fresh lookup:
1. its stream's next chain, when the target accepted the whole last chain and then the stream's next token (a
   deep match goes on for dozens of tokens; nothing is looked up);
2. else a deep match in the store's recent tier (what this process and its replicas served moments ago, in
   memory): a context whose last `DEEP_MATCH` tokens or more occurred before is drafting that text again, and
   its continuation needs neither the database nor a merge; while the target follows, the stream reads on in
   that text, so a repeat costs one search per request, not one per chain;
3. else the row's drafter: its parts looked up for all such rows at once (`prefetch_parts`: the store's tiers in
   one round trip, a dense part's neighbours in one search), merged with the recent tier and the prompt, and the
   best path of that tree (`best_chain`); a chain the prompt part copied from the row's own text after a match
   of its deepest length reads on there as the target follows (`ContextSource`, as in 2.) -- unless the
   `LookupGate` says the row's lookups do not pay for the CPU they cost (a row on text nobody served, in a large
   batch on a fast accelerator): then it rests a few steps.
Each chain is drafted as deep as the lookup allows (`STREAM_DEPTH`); a step hands out at most its room, and the
rest is the stream. The per-part accepted counts (what the learned row records) follow each chain's parts.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from crest_client.draft import Draft, empty_draft

from crest.decoding.drafter import drafted_parts, drafted_source
from crest.decoding.policy import DraftPolicy
from crest.drafters.lease import StoreLease
from crest.drafters.parts import BatchRow, prefetch_parts
from crest.integrations.chain import ChainStream, ContextSource, best_chain, chain_parts, discount_tail


def lookup_nodes(k: int) -> int:
    """Return the tree nodes a row's lookup merges its chain from, for chains of at most `k` tokens."""
    # merging costs in proportion to the nodes. `crest bench proposer --limit 48` (held-out stdlib files, K 8,
    # load 9): at concurrency 16 on texts seen before by nobody, 32 nodes gave M 1.196 at 8.1 ms of proposer CPU per
    # step, 16 nodes M 1.191 at 5.3 ms; at concurrency 1 M was 1.362 with both
    return max(16, min(64, 2 * k))


STREAM_DEPTH = 32  # deepest chain drafted per lookup: a step hands out at most K of it, the rest is the stream

DEEP_MATCH = 16  # tokens of context that must have occurred before for the recent tier alone to draft the row

# a looked-up chain's path probabilities fall by TAIL_DECAY a node past the match's depth + TAIL_SURE. On HumanEval
# answers at first sight (`crest bench proposer`'s runner, a forward of 45 ms + 4 ms a draft token, a CPU's shape):
# 1,031 draft tokens verified instead of 1,189, M 2.562 against 2.519, 4.5% more tokens/s; with a flat forward (a
# GPU's shape) M 2.698 against 2.714 (0.7 kept more and gained less: 2.8%)
TAIL_SURE, TAIL_DECAY = 2, 0.5

VALUE_DECAY = 0.9  # a row's estimate of the tokens its lookups get accepted follows its last ~10 lookups (bursty)

MAX_REST = 8  # steps a row whose lookups do not pay goes without one at most, before it tries again

COST_SAMPLES = 64  # the last steps' CPU per looked-up row whose median is a lookup's cost


@dataclass
class ProposerRow:
    """One request's state between steps: its drafter, tokens, last chain and figures for its learned row."""

    drafter: Any
    leases: dict[str, Any]  # part name -> the row's view, inside its drafter (`DraftHub.row_parts`)
    prompt_length: int  # -1: unknown (no request ids found): nothing learned
    tokens: list[int]
    hidden: np.ndarray | None = None  # [H] the state that predicted the last token, this step (None: unknown)
    chain: Draft = field(default_factory=empty_draft)  # the chain handed out for a context of `chain_at` tokens
    chain_at: int = -1
    predicted: float = 0.0  # the chain's weight-predicted accepted nodes, as the policy sized it
    stream: ChainStream = field(default_factory=ChainStream)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    learned: bool = False
    looked: bool = False  # the last chain came from a lookup (not the stream or a deep recent match)
    streamed: bool = False  # the last chain came from the stream of a lookup's chain: its tokens are that lookup's
    value: float = 1.0  # decayed chain tokens accepted per lookup (optimistic at first: a new row looks up)
    fresh: bool = False  # `value` learned from a lookup since the gate last looked at it
    rest: int = 0  # steps this row still goes without a lookup
    backoff: int = 0  # the length of its last rest

    @property
    def lease(self) -> StoreLease | None:
        """Return the row's view of its store (None: its drafter reads none)."""
        return self.leases.get("store")

    def verified(self, new: list[int]) -> int:
        """Count the step that verified this row's last chain (`new`: accepted tokens, then the bonus one); return
        the chain tokens accepted."""
        got = min(len(new) - 1, len(self.chain))
        for name, depth in self.stream.parts.items():  # a part's tree held the chain's first `depth` tokens
            if depth > 0 and got > 0:
                self.parts[name] = self.parts.get(name, 0) + min(got, depth)
        self.drafted, self.accepted = self.drafted + len(self.chain), self.accepted + got
        if self.looked:
            self.learn_value(got)
        elif self.streamed:  # the lookup that found the stream's chain paid this too
            self.value += (1.0 - VALUE_DECAY) * got
        return got

    def hand(self, chain: Draft, *, predicted: float = 0.0) -> None:
        """Hand the row `chain` to verify this step, its weight-predicted accepted nodes `predicted` (a looked-up
        row given nothing learns its lookup brought 0)."""
        self.chain, self.chain_at, self.predicted = chain, len(self.tokens), predicted
        if self.looked and not len(chain):
            self.learn_value(0)

    def learn_value(self, got: int) -> None:
        """Fold what a lookup's chain got accepted into the row's estimate (nothing drafted: 0)."""
        self.value, self.fresh = VALUE_DECAY * self.value + (1.0 - VALUE_DECAY) * got, True


class LookupGate:
    """Whether a row's lookup pays for the CPU it costs, counted in the whole engine's tokens.

    A row's lookup (its share of the round trip, the merge and the best chain) costs `cost` seconds of CPU, on the
    step's critical path; the engine makes `rate` new tokens a second. A lookup pays when the tokens it is expected
    to get accepted exceed cost x rate, what the engine makes in that time. A row's expectation is the decayed mean
    of what its last lookups got accepted; a row below that bar rests 1, 2, 4... up to `MAX_REST` steps between
    lookups, and one that pays again looks up every step. Where a forward takes tens of milliseconds (this CPU) the
    bar is near 0 and every row looks up; on a fast accelerator at a large batch, rows on unseen text rest.
    """

    def __init__(self) -> None:
        self._costs: deque[float] = deque(maxlen=COST_SAMPLES)  # seconds of CPU per looked-up row, by step
        self.cost = 0.0  # their median: a cold first lookup (a new connection, cold caches) must not set the bar
        self.rate = 0.0  # new tokens per second of the engine (decayed mean)
        self._last: float | None = None
        self.rested = 0  # lookups skipped, for the report

    def bar(self) -> float:
        """Return the accepted tokens a lookup must be expected to bring to pay for its CPU."""
        return self.cost * self.rate

    def step(self, tokens: int, *, now: float) -> None:
        """Count a step that brought `tokens` new tokens, at the engine's time `now` (seconds)."""
        if self._last is not None and now > self._last:
            rate = tokens / (now - self._last)
            self.rate = rate if self.rate == 0 else 0.9 * self.rate + 0.1 * rate
        self._last = now

    def looked(self, seconds: float, rows: int) -> None:
        """Count `rows` lookups that took `seconds` of CPU together."""
        if rows > 0:
            self._costs.append(seconds / rows)
            self.cost = statistics.median(self._costs)

    def rests(self, row: ProposerRow) -> bool:
        """Return whether the row goes without a lookup this step."""
        if row.rest > 0:
            row.rest -= 1
        elif row.fresh and row.value < self.bar():  # its last lookup did not pay: rest twice as long as last time
            row.fresh, row.backoff = False, min(MAX_REST, 2 * row.backoff or 1)
            row.rest = row.backoff - 1
        else:  # it pays, or it rested and tries again
            if row.value >= self.bar():
                row.backoff = 0
            return False
        self.rested += 1
        return True


def draft_chains(
    policy: DraftPolicy, live: Sequence[tuple[ProposerRow, int]], *, gate: LookupGate | None = None
) -> list[Draft]:
    """Return each (row, room)'s chain of at most `room` tokens: from its stream, a deep recent match, or its drafter
    (one store round trip for all of those the gate lets look up); each row's stream then follows its chain."""
    chains: list[Draft] = [empty_draft()] * len(live)
    looked: list[int] = []
    for j, (row, room) in enumerate(live):
        chain = row.stream.take(room, at=len(row.tokens))
        row.streamed = chain is not None and row.streamed  # the stream goes on from a lookup's chain
        if chain is None:
            chain = _deep_recent(row, room)
            row.streamed = chain is None  # a lookup's chain, or a deep match's (no lookup), starts the stream now
        row.looked = chain is None and (gate is None or not gate.rests(row))
        if chain is not None:
            chains[j] = chain
        elif row.looked:
            looked.append(j)
    if not looked:
        return chains
    cpu = time.thread_time()
    rows = [live[j][0] for j in looked]
    prefetch_parts([(r.leases, BatchRow(r.tokens, r.hidden)) for r in rows], max_nodes=policy.budget)
    for j in looked:
        row, room = live[j]
        tree = policy.draft(row.drafter, row.tokens, room=STREAM_DEPTH, chain=True)
        best = discount_tail(best_chain(tree, depth=STREAM_DEPTH), sure=tree.n + TAIL_SURE, factor=TAIL_DECAY)
        parts = drafted_parts(row.drafter, tree, context_length=len(row.tokens)) if len(best) else {}
        # a chain copied from earlier in the row's own text after a deep match reads on there, as a recent one does
        at = drafted_source(row.drafter, best.tokens.tolist(), context_length=len(row.tokens)) if len(best) else -1
        source = ContextSource(row.tokens) if at >= 0 else None
        row.stream.start(best, chain_parts(parts, best), at=len(row.tokens), source=source, source_at=at,
                         source_part="prompt")  # fmt: skip
        # a source reads on at once: a chain shorter than the room, accepted whole, is followed on by its bonus token
        read = row.stream.take(room, at=len(row.tokens)) if source is not None else None
        chains[j] = read if read is not None else best.truncate(room)
    if gate is not None:
        gate.looked(time.thread_time() - cpu, len(looked))
    return chains


def _deep_recent(row: ProposerRow, room: int) -> Draft | None:
    """Return the recent tier's chain for the row when its context matches `DEEP_MATCH` tokens or more, else None."""
    recent = row.lease.recent if row.lease is not None else None
    if recent is None or len(row.tokens) < DEEP_MATCH:
        return None
    try:
        tree, source_at = recent.follow(row.tokens, STREAM_DEPTH)
    except Exception:  # the merged drafter's own call will say it (logged once there)
        return None
    if tree is None or tree.n < DEEP_MATCH:
        return None
    best = best_chain(tree, depth=STREAM_DEPTH)
    if len(best) < min(room, 2):
        return None
    # one earlier text's continuation: the stream reads on in it while the target follows
    source = recent if source_at >= 0 and len(best) == len(tree) else None
    row.stream.start(best, {"recent": len(best)}, at=len(row.tokens), source=source, source_at=source_at)
    return best.truncate(room)
