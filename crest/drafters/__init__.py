"""Drafters: everything that proposes a token tree for the verifier, behind one protocol and one registry."""

from crest.decoding.drafter import Drafter, NoneDrafter
from crest.drafters.dense import DenseDrafter
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.registry import check_drafter, close_drafter, crest_names, make_drafter, open_drafter
from crest.drafters.store import PendingStore, StoreDrafter, open_store
from crest.drafters.suffix_array import RestDrafter, RestIndex
from crest.drafters.trie import build_draft, match_path, merge_drafts, score_draft

__all__ = [
    "DenseDrafter",
    "Drafter",
    "MergedDrafter",
    "NoneDrafter",
    "PendingStore",
    "PromptDrafter",
    "RestDrafter",
    "RestIndex",
    "StoreDrafter",
    "build_draft",
    "check_drafter",
    "close_drafter",
    "crest_names",
    "make_drafter",
    "match_path",
    "merge_drafts",
    "open_drafter",
    "open_store",
    "score_draft",
]
