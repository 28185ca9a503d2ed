"""Serving: continuous batching with per-row tree verification behind an OpenAI-compatible HTTP API."""

from crest.serving.batch import BatchCache, TreeRow, check_batchable
from crest.serving.scheduler import Outcome, QueueFull, Request, Scheduler, ShuttingDown

__all__ = [
    "BatchCache",
    "Outcome",
    "QueueFull",
    "Request",
    "Scheduler",
    "ShuttingDown",
    "TreeRow",
    "check_batchable",
]
