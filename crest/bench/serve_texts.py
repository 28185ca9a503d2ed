"""The texts of a `crest bench serve` run, kept beside its figures, and another run's rows as the reference.

Servers that draft their own way (vLLM's `ngram`, crest's proposer inside vLLM) are measured one server at a
time, so the `none` rows of a run against them live in another run. `save_texts` writes each row's texts to
`texts.json` in the run's folder; `compare_to_reference` reads a folder written that way (`--reference DIR`, as
a run of vLLM without speculation) and fills each row's speedup and its texts equal to the reference row at the
same concurrency: exactness across servers, with the reference's greedy texts standing for plain decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crest.errors import ConfigError

TEXTS_FILE = "texts.json"


def save_texts(out: Path, texts: dict[tuple[str, str, int], list[str | None]]) -> Path:
    """Write each row's texts (one per prompt, None for a failed request) to `out/texts.json`; return the path."""
    rows = [{"mode": m, "drafter": d, "concurrency": c, "texts": t} for (m, d, c), t in sorted(texts.items())]
    path = out / TEXTS_FILE
    path.write_text(json.dumps(rows, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def load_reference(folder: Path) -> dict[int, tuple[float, list[str | None]]]:
    """Return a saved run's tokens/s and texts per concurrency (its server rows of one drafter)."""
    try:
        figures = json.loads((folder / "serve.json").read_text(encoding="utf-8"))["rows"]
        saved = json.loads((folder / TEXTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--reference {folder}: not a `crest bench serve --out` folder with serve.json and {TEXTS_FILE} ({exc})"
        ) from None
    rows = [r for r in figures if r.get("mode") == "server"]
    if len({r.get("drafter") for r in rows}) != 1:
        raise ConfigError(f"--reference {folder}: its server rows must be of one drafter (or one --label)")
    texts = {int(t["concurrency"]): t["texts"] for t in saved if t.get("mode") == "server"}
    return {
        int(r["concurrency"]): (float(r["output_tokens_per_second"]), texts.get(int(r["concurrency"]), []))
        for r in rows
    }


def compare_to_reference(
    rows: list[Any],
    texts: dict[tuple[str, str, int], list[str | None]],
    reference: dict[int, tuple[float, list[str | None]]],
) -> None:
    """Fill each server row's speedup and equal texts against the reference row at its concurrency."""
    for row in rows:
        found = reference.get(row.concurrency)
        if row.mode != "server" or found is None:
            continue
        speed, ref = found
        if speed > 0:
            row.speedup_vs_none = row.output_tokens_per_second / speed
        mine = texts.get((row.mode, row.drafter, row.concurrency))
        if mine is not None and len(ref) == len(mine):
            row.same_text_as_none = sum(a is not None and a == b for a, b in zip(mine, ref, strict=True))
