"""Drafters: everything that proposes a token tree for the verifier, behind one protocol and one registry."""

from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.protocol import Drafter, NoneDrafter
from crest.drafters.registry import NAMES, make_drafter, open_drafter
from crest.drafters.store import StoreDrafter
from crest.drafters.suffix_array import RestDrafter, RestIndex
from crest.drafters.trie import build_draft, merge_drafts, score_draft

__all__ = [
    "NAMES",
    "Drafter",
    "MergedDrafter",
    "NoneDrafter",
    "PromptDrafter",
    "RestDrafter",
    "RestIndex",
    "StoreDrafter",
    "build_draft",
    "make_drafter",
    "merge_drafts",
    "open_drafter",
    "score_draft",
]
