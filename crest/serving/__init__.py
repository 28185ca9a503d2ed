"""Serving: continuous batching with per-row tree verification behind an OpenAI-compatible HTTP API."""

from crest.serving.batch import BatchCache, TreeRow, check_batchable
from crest.serving.request import Outcome, QueueFull, Request, ShuttingDown
from crest.serving.scheduler import Scheduler
from crest.serving.server import ServeOptions, build_app, run_app, serve

__all__ = [
    "BatchCache",
    "Outcome",
    "QueueFull",
    "Request",
    "Scheduler",
    "ServeOptions",
    "ShuttingDown",
    "TreeRow",
    "build_app",
    "check_batchable",
    "run_app",
    "serve",
]
