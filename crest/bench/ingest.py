"""`crest bench ingest`: a full ingest's summary as throughput per stage, peak memory and bytes per n-gram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crest import db
from crest.config import IngestOptions
from crest.ingest.pipeline import ingest


def bench_ingest(
    inputs: Sequence[str],
    *,
    store: str,
    tokenizer: str,
    dsn: str,
    options: IngestOptions,
    fmt: str = "auto",
    keep: bool = False,
) -> dict[str, Any]:
    """Run a full ingest into `store` and return its figures; the store is dropped afterwards unless `keep`."""
    summary = ingest(list(inputs), store=store, tokenizer=tokenizer, dsn=dsn, options=options, fmt=fmt)
    if not keep:
        with db.session(dsn) as conn:
            db.drop_store(conn, store)
    return ingest_figures(summary)


def ingest_figures(summary: Any) -> dict[str, Any]:
    """Return flat figures of an ingest: throughput per stage, peak memory and size."""
    tokens = max(1, int(summary.tokens))
    total = float(sum(summary.seconds.values()))
    figures: dict[str, Any] = {
        "documents": summary.documents,
        "tokens": summary.tokens,
        "ngrams_stored": summary.rows,
        "avg_tree_nodes": summary.avg_tree_nodes,
    }
    for stage, secs in summary.seconds.items():
        figures[f"{stage}_seconds"] = secs
        figures[f"{stage}_tokens_per_second"] = tokens / max(secs, 1e-9)
    figures.update(
        seconds=total,
        peak_rss_bytes=summary.peak_rss_bytes,
        bytes_on_disk=summary.table_bytes + summary.index_bytes,
        bytes_per_ngram=summary.bytes_per_ngram,
    )
    return figures
