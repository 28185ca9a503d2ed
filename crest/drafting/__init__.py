"""Drafting from stores and learning, composed once for `crest serve` and the vLLM proposer."""

from crest.drafting.hub import DraftHub, LearnOptions, RowParts, process_source

__all__ = ["DraftHub", "LearnOptions", "RowParts", "process_source"]
