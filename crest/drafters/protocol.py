"""The drafter protocol: anything with `draft(context_ids, max_nodes) -> Draft | None`, and the drafter of nothing.

The verifier, the benchmarks and the merged drafter depend on this protocol only. `NoneDrafter` drafts nothing,
so plain decoding runs through the same loop as speculative decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from crest_client.draft import Draft


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes a draft tree for a context."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None: ...


class NoneDrafter:
    """Drafts nothing: plain decoding through the speculative loop."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return no draft."""
        return None
