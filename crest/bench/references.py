"""Recorded plain greedy continuations: a benchmark run keeps them so later M-only runs replay without decoding.

A record is keyed by what the continuations depend on (model, device, dtype, length and the prompts' token ids),
so a run on other prompts or another model never reuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crest.bench.datastores import digest

REFERENCES = "references.json"  # the file a run's output folder records them in


@dataclass
class Reference:
    """A recorded plain greedy continuation, standing in for a generation result."""

    output_token_ids: list[int]
    new_tokens: int
    seconds: float


def reference_key(loaded: Any, prompt_ids: list[list[int]], opts: Any) -> str:
    """Return what a recorded set of greedy continuations depends on: model, dtype, prompts and length."""
    parts = [str(loaded.spec), opts.device, opts.dtype, str(opts.max_new_tokens), json.dumps(prompt_ids)]
    return digest(parts)


def known_references(path: Path, key: str, count: int) -> dict[str, Any] | None:
    """Return the record in `path` (`references`: `count` continuations, and their `seconds`) made under `key`,
    or None when there is none, it is unreadable or it was made for something else."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    refs = saved.get("references") if isinstance(saved, dict) else None
    if saved.get("key") != key or not isinstance(refs, list) or len(refs) != count:
        return None
    return saved | {"references": [[int(t) for t in ref] for ref in refs]}


def record_references(
    out: Path, loaded: Any, prompt_ids: list[list[int]], opts: Any, refs: list[list[int]], seconds: float
) -> None:
    """Record the greedy continuations (and the mean seconds of one) for later M-only runs on the same prompts."""
    key = reference_key(loaded, prompt_ids, opts)
    body = {"key": key, "references": refs, "seconds": [seconds] * len(refs)}
    (out / REFERENCES).write_text(json.dumps(body), encoding="utf-8")
