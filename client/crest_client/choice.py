"""Which stored suffix of a context drafts: the longest, or the one whose tree promises the most.

The longest stored suffix is the most specific evidence, but a rare n-gram's tree comes from a handful of
occurrences, and a store that keeps more n-grams hands more contexts such thin trees instead of the rich tree of a
shorter suffix: with the longest rule M falls as top-t grows. The `expected` rule looks up every stored suffix
length in the same round trip and keeps the one with the highest shrunk estimate that its first draft token is
right: the weight of its heaviest root child (read from a format-2 blob's header without decoding; a format-1 blob
is decoded) over the occurrences its tree was built from plus PRIOR pseudo-occurrences that agree with nothing,
`first / (occurrences + PRIOR)`. A tree built from few occurrences must then agree far more often to beat a tree
built from many, so a rare n-gram's thin tree no longer shadows a common suffix's; ties go to the longer suffix.
`longest` is the classic rule (the first hit of the longest-first probes). The rule is `Store.connect(rule=...)`,
else `CREST_SUFFIX_RULE`, else `DEFAULT_RULE`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from crest_client.codec import decode_tree
from crest_client.errors import CrestClientError

RULES = ("longest", "expected")
DEFAULT_RULE = "expected"
PRIOR = 256.0  # pseudo-occurrences added to every tree's count (docs/benchmarks.md: "Which suffix drafts")

# A live tier's trees come from what was served lately, a few occurrences each: the prior above (tuned on corpora)
# passes them over for short common suffixes, so a live tier drafts from its longest stored suffix
# (docs/learning.md, "Which suffix the live tier drafts from").
LIVE_RULE = "longest"


def built_rule(params: Mapping[str, Any] | None) -> str:
    """Return the `--suffix-rule` a version's params record; `lookup` (every row, its own tree) when none is."""
    return str((params or {}).get("suffix_rule") or "lookup")  # none: built before the option existed


def built_max_matches(params: Mapping[str, Any] | None) -> int:
    """Return the most occurrences a version built a tree from (`--max-matches`; 5000 when none is recorded)."""
    return int((params or {}).get("max_matches") or 5000)


def decided_at_ingest(params: Mapping[str, Any] | None) -> bool:
    """Return whether a version's rows were decided at ingest, so a lookup drafts from its longest stored suffix."""
    return built_rule(params) != "lookup"


def rule_for(tier: str, rule: str) -> str:
    """Return the suffix rule a tier is read with: `rule` for the static tier, `LIVE_RULE` for a live one."""
    return rule if tier == "static" else LIVE_RULE


def resolve_rule(rule: str | None = None) -> str:
    """Return the suffix rule: the argument, else CREST_SUFFIX_RULE, else the default; raise on an unknown one."""
    value = (rule or os.environ.get("CREST_SUFFIX_RULE") or DEFAULT_RULE).strip().lower()
    if value not in RULES:
        raise CrestClientError(f"unknown suffix rule {value!r}: use one of {', '.join(RULES)}")
    return value


def first_weight(tree: bytes) -> int | None:
    """Return the weight of a format-2 blob's first (heaviest) node from its header; None for other blobs."""
    if len(tree) < 4 or tree[0] != 2:
        return None
    pos = 2
    while pos < len(tree) and tree[pos] & 0x80:  # the node count (LEB128)
        pos += 1
    pos += 1 if tree[1] & 0x01 else 2  # ranked blobs have no widest-class byte
    value = shift = 0
    while pos < len(tree):
        byte = tree[pos]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
        pos, shift = pos + 1, shift + 7
    return None


def promise(n: int, count: int, tree: bytes, *, max_matches: int) -> float:
    """Return the estimated chance that the tree's first draft token is right (-1 when the header says nothing)."""
    first = first_weight(tree)
    if first is None:  # a format-1 blob keeps its weights in a byte array: decode it
        try:
            weights = decode_tree(tree).weights
        except CrestClientError:
            return -1.0
        if not len(weights):
            return -1.0
        first = int(weights[0])
    built_from = max(1, min(int(count), int(max_matches)))  # trees are built from a sample of max_matches
    return first / (built_from + PRIOR)


def rank(n: int, count: int, tree: bytes, *, max_matches: int) -> tuple[float, int]:
    """Return the `expected` rule's sort key of an (n, count, tree) row: its promise, then its length."""
    return promise(n, count, tree, max_matches=max_matches), int(n)


def choose(rows: Sequence[tuple[int, int, bytes]], *, max_matches: int) -> int:
    """Return the index of the (n, count, tree) row to draft from: the most promising, longer on ties."""
    best, best_key = 0, (-2.0, -1)
    for j, (n, count, tree) in enumerate(rows):
        key = rank(n, count, tree, max_matches=max_matches)
        if key > best_key:
            best, best_key = j, key
    return best
