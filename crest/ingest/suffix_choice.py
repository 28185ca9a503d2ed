"""Choosing a store's suffix rule at ingest on a held-out slice of its own corpus (`--suffix-rule auto`).

Neither client rule wins everywhere: the longest stored suffix drafts best from a small store, where long n-grams
are common ones, and the `expected` rule (which `prune` stores in one row a lookup) from a large one, where rare
long n-grams' thin trees shadow their suffixes' rich ones. `auto` decides per build, without the prompts it will
be measured on: a seeded slice of the corpus's documents (`HELD_FRACTION` of its tokens, at most `HELD_TOKENS`) is
left out of the build, and at up to `POSITIONS` sampled positions of that slice the tree each rule would draft
from is matched against the tokens that follow there (`crest_client.merge.match_path`, what greedy verification
accepts). The rule with the higher mean accepted length plus one (a proxy of M) is kept, `prune` on a tie (fewer
bytes): `prune` drops the rows `expected` never drafts from, `longest` keeps every row. Either way a lookup reads
one row, the longest stored suffix (the client reads every rule but `lookup` so), and the choice and both
estimates are recorded in the version's figures (`suffix_choice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from crest_client.codec import TokenTable, decode_tree
from crest_client.draft import Draft
from crest_client.merge import match_path

HELD_FRACTION = 0.01  # of the corpus's tokens held out of an `auto` build to choose its rule on
HELD_TOKENS = 200_000  # at most
POSITIONS = 4000  # held-out positions the rules are compared at, at most

Row = tuple[bytes, int, int, bytes]  # (key, n, count, tree) as stored


@dataclass
class Choice:
    """The rule an `auto` build chose, and the held-out estimates it chose by."""

    rule: str  # prune | longest
    m_prune: float
    m_longest: float
    positions: int
    held_documents: int
    held_tokens: int

    def figures(self) -> dict[str, Any]:
        """Return the choice as the version's figures record it."""
        return asdict(self)


def split_held_out(
    tokens: np.ndarray, offsets: np.ndarray, *, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (build tokens, build offsets, held-out tokens, held-out offsets): whole documents, seeded.

    Documents are held out in a seeded order until `HELD_FRACTION` of the tokens (at most `HELD_TOKENS`) is; at
    least one document always stays in the build, and a corpus of one document holds nothing out.
    """
    # tokens: [N] int32, offsets: [D + 1] int64
    docs = offsets.shape[0] - 1
    lengths = np.diff(offsets)
    goal = min(HELD_TOKENS, int(HELD_FRACTION * int(offsets[-1]))) if docs > 1 else 0
    held = np.zeros(docs, dtype=bool)
    taken = 0
    for d in np.random.default_rng(seed).permutation(docs).tolist():
        if taken >= goal or held.sum() >= docs - 1:
            break
        held[d], taken = True, taken + int(lengths[d])
    return (*_take(tokens, offsets, ~held), *_take(tokens, offsets, held))


def _take(tokens: np.ndarray, offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the tokens and offsets of the documents where `keep` holds, in order."""
    parts = [tokens[offsets[d] : offsets[d + 1]] for d in np.flatnonzero(keep).tolist()]
    lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
    joined = np.concatenate(parts).astype(tokens.dtype) if parts else np.zeros(0, tokens.dtype)
    return joined, np.r_[0, np.cumsum(lengths)].astype(np.int64)


def choose_rule(
    rows: Sequence[Row],
    keep: Sequence[bool],
    held: tuple[np.ndarray, np.ndarray],
    *,
    width: int,
    max_n: int,
    length: int,
    table: TokenTable | None,
    seed: int,
) -> Choice:
    """Return the rule whose trees match the held-out text better: `prune` (rows where `keep`) or `longest` (all)."""
    tokens, offsets = held
    stored = {key: (n, tree, kept) for (key, n, _, tree), kept in zip(rows, keep, strict=True)}
    at = _positions(offsets, seed=seed)
    decoded: dict[bytes, Draft] = {}
    scores = {"prune": 0, "longest": 0}
    for p, end in at:
        context = tokens[max(p - max_n, 0) : p].astype(f">u{width}").tobytes()
        truth = tokens[p : min(end, p + length)].tolist()
        longest = pruned = None
        for cut in range(0, len(context), width):  # suffixes longest first
            found = stored.get(context[cut:])
            if found is None:
                continue
            if longest is None:
                longest = context[cut:]
            if found[2]:
                pruned = context[cut:]
                break
        for rule, key in (("longest", longest), ("prune", pruned)):
            if key is not None:
                if key not in decoded:
                    n, tree, _ = stored[key]
                    decoded[key] = decode_tree(tree, n=n, table=table)
                scores[rule] += len(match_path(decoded[key], truth))
    count = max(1, len(at))
    m_prune, m_longest = 1 + scores["prune"] / count, 1 + scores["longest"] / count
    return Choice(
        rule="prune" if m_prune >= m_longest else "longest",
        m_prune=round(m_prune, 4),
        m_longest=round(m_longest, 4),
        positions=len(at),
        held_documents=int(offsets.shape[0] - 1),
        held_tokens=int(offsets[-1]) if offsets.shape[0] else 0,
    )


def _positions(offsets: np.ndarray, *, seed: int) -> list[tuple[int, int]]:
    """Return up to `POSITIONS` seeded (position, its document's end) pairs with a token before and one after."""
    starts, ends = offsets[:-1], offsets[1:]
    spans = np.maximum(ends - starts - 1, 0)  # [D] positions p with start < p < end
    total = int(spans.sum())
    if total == 0:
        return []
    picks = np.sort(np.random.default_rng(seed).choice(total, size=min(POSITIONS, total), replace=False))
    doc = np.searchsorted(np.cumsum(spans), picks, side="right")  # [P] the document of each pick
    before = np.r_[0, np.cumsum(spans)[:-1]]
    p = starts[doc] + 1 + (picks - before[doc])
    return list(zip(p.tolist(), ends[doc].tolist(), strict=True))
