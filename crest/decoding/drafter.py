"""The drafter protocol: anything with `draft(context_ids, max_nodes) -> Draft | None`, and the drafter of nothing.

The verifier, the benchmarks and the merged drafter depend on this protocol only. `NoneDrafter` drafts nothing,
so plain decoding runs through the same loop as speculative decoding. A drafter may also report the named parts
behind its last draft (`drafted_parts`: the static and live tiers of a store, the prompt), which learning counts
per part; a drafter without that method has no parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from crest_client.draft import Draft


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes a draft tree for a context."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None: ...


def drafted_parts(drafter: object, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
    """Return the named parts' trees behind `tree`, the drafter's draft for a context of this length."""
    report = getattr(drafter, "drafted_parts", None)
    return dict(report(tree, context_length=context_length)) if report is not None else {}


def drafted_source(drafter: object, chain: list[int], *, context_length: int) -> int:
    """Return the position in the context after an earlier copy of `chain` that the drafter's last draft, for a
    context of this length, found by a deep match (its text can be read on there); -1 when it found none."""
    source = getattr(drafter, "source_at", None)
    return int(source(chain, context_length=context_length)) if source is not None else -1


class NoneDrafter:
    """Drafts nothing: plain decoding through the speculative loop."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return no draft."""
        return None
