"""Decoding: target models, the tree layout of a draft, lossless acceptance, draft sizing and the generator."""

from crest.decoding.generator import DecodeState, GenerationResult, SpeculativeGenerator
from crest.decoding.models import LoadedModel, load_model
from crest.decoding.policy import DraftPolicy, choose_draft_size, room_left
from crest.decoding.sizing import CostModel, calibrate

__all__ = [
    "CostModel",
    "DecodeState",
    "DraftPolicy",
    "GenerationResult",
    "LoadedModel",
    "SpeculativeGenerator",
    "calibrate",
    "choose_draft_size",
    "load_model",
    "room_left",
]
