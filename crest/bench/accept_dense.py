"""The dense rows of `crest bench accept`: dense datastores at several sizes and the hybrids built on them.

A dense datastore is a store ingested with a dense part of `positions` embedded positions (`crest.ingest.dense`;
its n-gram part is a token one, never read), from the run's corpus or from `dense_corpus` (such as the model's own
responses to other prompts, `crest answer`); its size is its dense table + HNSW index. The position
counts default to ones whose dense parts land near the REST indexes' bytes, so dense and REST meet at equal bytes.
A hybrid (`crest+dense`, `crest+dense+prompt`) reads the n-grams of the crest store of top-t `dense_top_t` and the
dense part of one dense datastore; its size is the sum of both. The drafters are fed the target's hidden states by
the replay (`crest.bench.replay.reference_hidden`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from crest.bench.accept_options import DENSE_DRAFTERS, AcceptOptions
from crest.bench.datastores import Corpus, Variant, build_store, digest, size_tag
from crest.config import IngestOptions
from crest.errors import ConfigError

DENSE_BYTES_PER_ROW = 1000  # rough cost of a 64-dim row with its HNSW links, used only to pick position counts
TOKEN_NGRAMS = IngestOptions(max_n=1, top_t=1)  # a dense datastore's n-gram part: required by ingest, never read


def wants_dense(opts: AcceptOptions) -> bool:
    """Return whether the run measures a drafter that needs a dense datastore."""
    return any(d in DENSE_DRAFTERS for d in opts.drafters)


def auto_positions(rest: Sequence[Variant]) -> list[int]:
    """Return position counts whose dense parts should land near the REST indexes' sizes (two significant digits)."""
    return sorted({int(float(f"{max(100, v.nbytes // DENSE_BYTES_PER_ROW):.2g}")) for v in rest})


def dense_corpus(opts: AcceptOptions, corpus: Corpus) -> tuple[Corpus, str]:
    """Return the corpus the dense parts embed and the tag naming their stores ("" for the run's own corpus)."""
    if not opts.dense_corpus:
        return corpus, ""
    inputs = list(opts.dense_corpus)
    key = digest(["dense", *inputs, *map(size_tag, inputs)])
    return Corpus(inputs, "auto", key), f"_{key[:8]}"


def build_dense_stores(
    opts: AcceptOptions,
    corpus: Corpus,
    *,
    positions: Sequence[int],
    model: str,
    dsn: str,
    out: Path,
    setting: str,
    note: Callable[[str], None] = lambda line: None,
) -> list[Variant]:
    """Build (or reuse) one dense datastore per position count; return them sized by their dense parts."""
    from dataclasses import replace

    from crest.ingest.dense import DenseOptions

    source, tag = dense_corpus(opts, corpus)
    found = []
    for count in positions:
        dense = DenseOptions(
            model=model,
            dims=opts.dense_dims,
            positions=count,
            continuation=opts.dense_continuation,
            seed=opts.seed,
            precision=opts.dense_precision,
            device=opts.device,  # the run's model device: a GPU run embeds there too
        )
        name = f"acc_{setting}_dense{tag}_{opts.dense_precision}_p{count}"
        built = build_store(
            source,
            name=name,
            tokenizer=model,
            dsn=dsn,
            options=TOKEN_NGRAMS,
            out=out,
            rebuild=opts.rebuild,
            dense=dense,
        )
        found.append(replace(built, kind="dense", nbytes=built.dense_bytes, top_t=None, rows=0, dense_store=name))
        note(f"dense datastore {name}: {built.positions:,} positions, {built.dense_bytes:,} bytes")
    return found


def hybrids(crest: Sequence[Variant], dense: Sequence[Variant], *, top_t: int | None) -> list[Variant]:
    """Return the hybrid of each dense datastore with the crest store of `top_t` (None: the largest).

    `crest` holds one store per top-t (the count rule's).
    """
    if not crest or not dense:
        return []
    chosen = [v for v in crest if top_t is None or v.top_t == top_t]
    base = max(chosen, key=lambda v: v.top_t or 0) if chosen else None
    if base is None:
        raise ConfigError(f"--dense-top-t {top_t} is not one of the run's top-t values")
    return [
        Variant(
            kind="hybrid",
            name=f"{base.name}+{d.name}",
            nbytes=base.nbytes + d.nbytes,
            top_t=base.top_t,
            rows=base.rows,
            dense_bytes=d.nbytes,
            positions=d.positions,
            store=base.name,
            dense_store=d.name,
        )
        for d in dense
    ]


def open_indexes(dense: Sequence[Variant], *, dsn: str, fingerprint: str) -> dict[str, Any]:
    """Return each dense datastore's dense part opened for lookups, by store name."""
    from crest.drafters.dense_index import open_dense

    opened: dict[str, Any] = {}
    try:
        for v in dense:
            opened[v.dense_store] = open_dense(v.dense_store, dsn=dsn, fingerprint=fingerprint, connect_timeout=10.0)
    except BaseException:
        for index in opened.values():
            index.close()
        raise
    return opened
