"""The report of `crest bench serve`: a run's comparisons and its plot (docs/benchmarks.md holds the targets).

`comparisons` compares each drafter with `none` at the same concurrency and the top level with the batch-1
baseline; `append_comparisons` adds them to `serve.md`; `write_plot` draws output tokens/s against concurrency per
drafter with matplotlib's Agg backend (no plot, and a note, when matplotlib is missing).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crest.bench.serve_figures import ServeFigures


def comparisons(rows: Sequence[ServeFigures]) -> list[dict[str, Any]]:
    """Return the ratios these rows give (against none, against batch-1 decoding) and the errors under load."""
    server = [r for r in rows if r.mode == "server"]
    if not server:
        return []
    low, high = min(r.concurrency for r in server), max(r.concurrency for r in server)
    at = {(r.drafter, r.concurrency): r for r in server}
    batch1 = {r.drafter: r for r in rows if r.mode == "batch-1"}
    found: list[dict[str, Any]] = []

    def add(figure: str, value: float | None) -> None:
        if value is not None:
            found.append({"figure": figure, "value": round(value, 3)})

    if low == 1 and ("crest+prompt", 1) in at:
        add("concurrency 1: crest+prompt tokens/s over none", at["crest+prompt", 1].speedup_vs_none)
    for name in ("prompt", "crest", "crest+prompt"):
        if (name, high) in at and high > 1:
            add(f"concurrency {high}: {name} tokens/s over none", at[name, high].speedup_vs_none)
    for name, base in batch1.items():
        if (name, high) in at and high > 1 and base.output_tokens_per_second > 0:
            ratio = at[name, high].output_tokens_per_second / base.output_tokens_per_second
            add(f"concurrency {high}: {name} tokens/s over batch-1 decoding", ratio)
    found.append({"figure": "errors under load", "value": sum(r.errors for r in server)})
    return found


def write_plot(rows: Sequence[ServeFigures], path: Path) -> Path | None:
    """Plot output tokens/s against concurrency per drafter (batch-1 as dashed lines); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'crest[bench]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    drafters = list(dict.fromkeys(r.drafter for r in rows))
    for i, name in enumerate(drafters):
        mine = sorted((r for r in rows if r.drafter == name and r.mode == "server"), key=lambda r: r.concurrency)
        color = f"C{i}"
        if mine:
            xs, ys = [r.concurrency for r in mine], [r.output_tokens_per_second for r in mine]
            ax.plot(xs, ys, marker="o", color=color, label=name)
        for r in rows:
            if r.drafter == name and r.mode == "batch-1":
                ax.axhline(r.output_tokens_per_second, color=color, linestyle="--", linewidth=0.8)
    levels = sorted({r.concurrency for r in rows if r.mode == "server"})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("crest serve: output tokens/s (dashed: batch-1, one prompt at a time)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def append_comparisons(found: Sequence[dict[str, Any]], path: Path) -> None:
    """Append the comparisons to the run's markdown file."""
    if not found or not path.exists():
        return
    lines = ["", "## Comparisons", "", "| figure | value |", "| --- | --- |"]
    lines += [f"| {c['figure']} | {c['value']} |" for c in found]
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
