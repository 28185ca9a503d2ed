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


def known_references(out: Path, loaded: Any, prompt_ids: list[list[int]], opts: Any) -> Any:
    """Return the greedy continuations recorded in `out` for these prompts, or None."""
    try:
        saved = json.loads((out / "references.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if saved.get("key") != reference_key(loaded, prompt_ids, opts) or len(saved.get("references", [])) != len(
        prompt_ids
    ):
        return None
    return saved


def record_references(
    out: Path, loaded: Any, prompt_ids: list[list[int]], opts: Any, refs: list[list[int]], seconds: float
) -> None:
    """Record the greedy continuations (and the mean seconds of one) for later M-only runs on the same prompts."""
    key = reference_key(loaded, prompt_ids, opts)
    body = {"key": key, "references": refs, "seconds": [seconds] * len(refs)}
    (out / "references.json").write_text(json.dumps(body), encoding="utf-8")
