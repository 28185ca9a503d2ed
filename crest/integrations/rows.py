"""The proposer's rows and their chains: the hot path of a vLLM step, which must cost well under a GPU step.

A row (one request) keeps its drafter, its tokens and a `ChainStream`, the rest of the last best chain it drafted.
Each step, every row that drafts gets its chain the cheapest way that is as good as a fresh lookup:
1. its stream's next chain, when the target accepted the whole last chain and then the stream's next token (a
   deep match goes on for dozens of tokens; nothing is looked up);
2. else a deep match in the store's recent tier (what this process and its replicas served moments ago, in
   memory): a context whose last `DEEP_MATCH` tokens or more occurred before is drafting that text again, and
   its continuation needs neither the database nor a merge;
3. else the row's drafter: its parts looked up for all such rows at once (`prefetch_parts`: the store's tiers in
   one round trip, a dense part's neighbours in one search), merged with the recent tier and the prompt, and the
   best path of that tree (`best_chain`).
Each chain is drafted as deep as the lookup allows (`STREAM_DEPTH`); a step hands out at most its room, and the
rest is the stream. The per-part accepted counts (what the learned row records) follow each chain's parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from crest_client.draft import Draft, empty_draft

from crest.decoding.drafter import drafted_parts
from crest.decoding.policy import DraftPolicy
from crest.drafters.lease import StoreLease
from crest.drafters.parts import BatchRow, prefetch_parts
from crest.integrations.chain import ChainStream, best_chain, chain_parts


def lookup_nodes(k: int) -> int:
    """Return the tree nodes a row's lookup merges its chain from, for chains of at most `k` tokens."""
    # merging costs in proportion to the nodes. `crest bench proposer --limit 48` (held-out stdlib files, K 8,
    # load 9): at concurrency 16 on texts seen before by nobody, 32 nodes gave M 1.196 at 8.1 ms of proposer CPU per
    # step, 16 nodes M 1.191 at 5.3 ms; at concurrency 1 M was 1.362 with both
    return max(16, min(64, 2 * k))


STREAM_DEPTH = 32  # deepest chain drafted per lookup: a step hands out at most K of it, the rest is the stream

DEEP_MATCH = 16  # tokens of context that must have occurred before for the recent tier alone to draft the row


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
    stream: ChainStream = field(default_factory=ChainStream)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    learned: bool = False

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
        return got


def draft_chains(policy: DraftPolicy, live: Sequence[tuple[ProposerRow, int]]) -> list[Draft]:
    """Return each (row, room)'s chain of at most `room` tokens: from its stream, a deep recent match, or its drafter
    (one store round trip for all of those); each row's stream then follows its chain."""
    chains: list[Draft] = [empty_draft()] * len(live)
    looked: list[int] = []
    for j, (row, room) in enumerate(live):
        chain = row.stream.take(room, at=len(row.tokens))
        if chain is None:
            chain = _deep_recent(row, room)
        if chain is None:
            looked.append(j)
        else:
            chains[j] = chain
    rows = [live[j][0] for j in looked]
    prefetch_parts([(r.leases, BatchRow(r.tokens, r.hidden)) for r in rows], max_nodes=policy.budget)
    for j in looked:
        row, room = live[j]
        tree = policy.draft(row.drafter, row.tokens, room=STREAM_DEPTH)
        best = best_chain(tree, depth=STREAM_DEPTH)
        parts = drafted_parts(row.drafter, tree, context_length=len(row.tokens)) if len(best) else {}
        row.stream.start(best, chain_parts(parts, best), at=len(row.tokens))
        chains[j] = best.truncate(room)
    return chains


def _deep_recent(row: ProposerRow, room: int) -> Draft | None:
    """Return the recent tier's chain for the row when its context matches `DEEP_MATCH` tokens or more, else None."""
    recent = row.lease.recent if row.lease is not None else None
    if recent is None or len(row.tokens) < DEEP_MATCH:
        return None
    try:
        tree = recent.draft(row.tokens, STREAM_DEPTH)
    except Exception:  # the merged drafter's own call will say it (logged once there)
        return None
    if tree is None or tree.n < DEEP_MATCH:
        return None
    best = best_chain(tree, depth=STREAM_DEPTH)
    if len(best) < min(room, 2):
        return None
    row.stream.start(best, {"recent": len(best)}, at=len(row.tokens))
    return best.truncate(room)
