"""The dense part of a store version (DReSD): the target's hidden states at sampled corpus positions, in pgvector.

`build_dense` runs inside a version's build, before it is published, so the dense part is published, retired
and cleaned up with the n-gram part. It samples up to `positions` corpus positions (seeded whole windows of
`window` tokens, each position with at least two tokens after it in its document), runs the model over those
windows (batched, right-padded, which a causal model never sees; no LM head), and writes each sampled
position's last hidden state to a float32 file on disk while it accumulates their first and second moments (of
at most `fit_limit` of them), so memory holds one batch and an H x H matrix, not the states. From the moments:
the mean and standard deviation standardise, the top `dims` eigenvectors of the standardised covariance reduce
(PCA), and each reduced vector is L2-normalised; the vectors are then streamed from the file into the version's
pgvector table with the `continuation` tokens after their position (the first of them is the token the state
predicted) and indexed with the ANN index `index` names (IVFFlat by default, HNSW selectable; its parameters
follow from the row count, `crest.db.dense.AnnIndex`, and are recorded in the part's figures) in the column type
`precision` names (half: pgvector's float16 halfvec, the default; single: float32 vector).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from crest_client.embedded import crest_home

from crest.config import DEFAULT_DENSE_PRECISION, fault_pause
from crest.db import dense as dense_db
from crest.decoding.hidden import final_hidden, model_fingerprint
from crest.decoding.models import check_device
from crest.errors import ConfigError, ModelError, TokenizerError
from crest.ingest.loader import Reporter, SilentReporter

_CHUNK_ROWS = 1 << 15  # states projected and copied at once


@dataclass(frozen=True)
class DenseOptions:
    """How the dense part is built: model, vector dims, sampled positions, continuation, batching, index, precision."""

    model: str
    dims: int = 64
    positions: int = 200_000
    continuation: int = 16
    window: int = 512
    batch: int = 8
    fit_limit: int = 1_000_000
    seed: int = 0
    engine: str = "inprocess"  # the ingest engine it is built in: the in-process one only
    index: str = dense_db.INDEX_KINDS[0]  # the ANN index kind (crest.db.dense.INDEX_KINDS)
    precision: str = DEFAULT_DENSE_PRECISION  # half (halfvec, float16) or single (vector, float32)
    device: str = "cpu"  # where the model runs: cpu or cuda[:N] (float32 either way: the fingerprint rule)

    def validate(self) -> DenseOptions:
        """Return self, or raise ConfigError naming the first bad value."""
        if self.engine != "inprocess":
            raise ConfigError(f"--dense-model builds with --engine inprocess only, not {self.engine}")
        if self.index not in dense_db.INDEX_KINDS:
            raise ConfigError(f"--dense-index must be one of {', '.join(dense_db.INDEX_KINDS)}, not {self.index!r}")
        try:
            check_device(self.device)
        except ModelError as exc:
            raise ConfigError(f"--dense-device: {exc}") from None
        if self.precision not in dense_db.PRECISIONS:
            raise ConfigError(
                f"--dense-precision must be one of {', '.join(dense_db.PRECISIONS)}, not {self.precision!r}"
            )
        for label, value, low, high in (
            ("--dense-dims", self.dims, 2, 4096),
            ("--dense-positions", self.positions, 1, 10**10),
            ("--dense-continuation", self.continuation, 2, 256),
            ("--dense-window", self.window, 2, 1 << 20),
            ("--dense-batch", self.batch, 1, 4096),
        ):
            if not low <= value <= high:
                raise ConfigError(f"{label} must be between {low} and {high}, got {value}")
        return self


def sample_positions(offsets: np.ndarray, *, count: int, seed: int, window: int) -> np.ndarray:
    """Return up to `count` sorted corpus positions, each with at least two tokens after it in its document.

    Whole windows are drawn (seeded; a window is `window` tokens of one document, aligned to its start) and all
    their positions kept, since one forward over a window yields every position's state: the model runs over
    about `count` tokens, not over the corpus.
    """
    # offsets: [D + 1]; a document of length m has m - 2 positions with two tokens after them
    lengths = np.maximum(np.diff(offsets), 0)  # [D]
    per_doc = -(-lengths // window)  # [D] windows per document
    first = np.concatenate(([0], np.cumsum(per_doc)))  # [D + 1]
    if first[-1] == 0:
        return np.zeros(0, dtype=np.int64)
    doc = np.repeat(np.arange(lengths.shape[0]), per_doc)  # [W] document of each window
    start = offsets[doc] + (np.arange(first[-1]) - first[doc]) * window  # [W]
    valid = np.maximum(np.minimum(start + window, offsets[doc + 1] - 2) - start, 0)  # [W] positions per window
    order = np.random.default_rng(seed).permutation(first[-1])
    taken = order[: int(np.searchsorted(np.cumsum(valid[order]), count)) + 1]  # windows until `count` positions
    taken = np.sort(taken[valid[taken] > 0])
    if taken.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    picked = np.concatenate([np.arange(start[w], start[w] + valid[w]) for w in taken.tolist()])
    return picked[:count].astype(np.int64) if picked.shape[0] <= count else _thin(picked, count, seed)


def _thin(picked: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Return `count` of the sorted positions, seeded, still sorted."""
    keep = np.sort(np.random.default_rng(seed + 1).choice(picked.shape[0], size=count, replace=False))
    return picked[keep].astype(np.int64)


def build_dense(
    build: Any,
    tokens: np.ndarray,
    offsets: np.ndarray,
    *,
    options: DenseOptions,
    fingerprint: str,
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    """Embed, project, load and index the dense part of the build's version; return its figures.

    `fingerprint` is the store's tokenizer fingerprint: the model's tokenizer must match it (TokenizerError).
    """
    from crest.decoding.models import load_model

    options.validate()
    rep = reporter or SilentReporter()
    started = time.perf_counter()
    loaded = load_model(options.model, device=options.device)
    model = loaded.model
    from crest.decoding.tokenizer import load_tokenizer

    if load_tokenizer(options.model).fingerprint != fingerprint:
        raise TokenizerError(f"--dense-model {options.model!r} has another tokenizer than the store's")
    conn = build.conn
    dense_db.ensure_vector(conn)
    offsets = np.asarray(offsets, dtype=np.int64)
    positions = sample_positions(offsets, count=options.positions, seed=options.seed, window=options.window)
    if positions.shape[0] == 0:
        raise ConfigError("no corpus position has two tokens after it: the corpus is too short for a dense part")
    hidden = int(model.config.hidden_size)
    dims = min(options.dims, hidden)
    with _scratch() as work:
        states = np.lib.format.open_memmap(
            work / "states.npy", mode="w+", dtype=np.float32, shape=(positions.shape[0], hidden)
        )  # [S, H] on disk
        moments = _Moments(hidden, limit=options.fit_limit)
        progress = rep.stage("dense: embed", int(positions.shape[0]))
        for rows, block in _embed(model, tokens, offsets, positions, options):
            states[rows] = block
            moments.add(block)
            progress(len(rows))
        rep.done("dense: embed")
        embed_seconds = time.perf_counter() - started
        mean, scale, components, explained = moments.projection(dims)
        vector = dense_db.vector_type(options.precision)
        dense_db.create_table(conn, build.store_id, dims=dims, vector=vector)
        t0 = time.perf_counter()
        loading = _rows(states, positions, tokens, offsets, options, (mean, scale, components))
        written = dense_db.copy_rows(conn, build.store_id, loading)
        fault_pause("dense")  # test hook: the rows are in, not indexed nor published
        index = dense_db.AnnIndex.for_rows(options.index, written, vector=vector)
        dense_db.finish_table(conn, build.store_id, index=index)
        load_seconds = time.perf_counter() - t0
    figures = {
        **dense_db.table_bytes(conn, build.store_id),
        "rows": written,
        "index": index.record(),
        "fit_rows": moments.count,
        "explained_variance": round(explained, 4),
        "seconds": {"embed": round(embed_seconds, 3), "load_index": round(load_seconds, 3)},
        "options": asdict(options),
        "device": str(next(model.parameters()).device),
    }
    meta = dense_db.DenseMeta(
        store_id=build.store_id,
        model=str(Path(options.model).resolve()) if Path(options.model).exists() else options.model,
        model_fingerprint=model_fingerprint(model),
        continuation=options.continuation,
        mean=mean,
        scale=scale,
        components=components,
        figures=figures,
    )
    dense_db.write_meta(conn, meta)
    return figures


class _Moments:
    """First and second moments of up to `limit` hidden states, in float64 (sum [H], sum of outer products [H, H])."""

    def __init__(self, hidden: int, *, limit: int) -> None:
        self.limit, self.count = limit, 0
        self.total = np.zeros(hidden, dtype=np.float64)
        self.outer = np.zeros((hidden, hidden), dtype=np.float64)

    def add(self, block: np.ndarray) -> None:
        take = block[: max(0, self.limit - self.count)].astype(np.float64)  # [b, H]
        self.count += take.shape[0]
        self.total += take.sum(axis=0)
        self.outer += take.T @ take

    def projection(self, dims: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Return (mean [H], 1 / std [H], components [H, dims], explained variance share) of the states seen."""
        n = max(1, self.count)
        mean = self.total / n
        cov = self.outer / n - np.outer(mean, mean)  # [H, H]
        std = np.sqrt(np.maximum(np.diag(cov), 0.0))
        scale = 1.0 / np.maximum(std, 1e-6)
        corr = cov * np.outer(scale, scale)  # covariance of the standardised states
        values, vectors = np.linalg.eigh(corr)  # ascending
        top = np.argsort(values)[::-1][:dims]
        explained = float(values[top].sum() / max(values.sum(), 1e-12))
        return mean.astype(np.float32), scale.astype(np.float32), vectors[:, top].astype(np.float32), explained


def _embed(
    model: Any, tokens: np.ndarray, offsets: np.ndarray, positions: np.ndarray, options: DenseOptions
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (row indexes into `positions`, their hidden states [b, H]) for batches of windows holding them."""
    device = next(model.parameters()).device
    doc = np.searchsorted(offsets, positions, side="right") - 1  # [S]
    start = offsets[doc] + (positions - offsets[doc]) // options.window * options.window  # window start per row
    windows, first = np.unique(start, return_index=True)  # rows are sorted, so each window's rows are contiguous
    bounds = np.append(first, positions.shape[0])
    for b in range(0, windows.shape[0], options.batch):
        picked = range(b, min(b + options.batch, windows.shape[0]))
        ends = [min(int(windows[w]) + options.window, int(offsets[doc[first[w]] + 1])) for w in picked]
        width = max(end - int(windows[w]) for w, end in zip(picked, ends, strict=True))
        ids = np.zeros((len(picked), width), dtype=np.int64)  # right-padded: a causal model never sees the padding
        for j, (w, end) in enumerate(zip(picked, ends, strict=True)):
            ids[j, : end - int(windows[w])] = tokens[int(windows[w]) : end]
        states = final_hidden(model, torch.from_numpy(ids).to(device)).float().cpu().numpy()  # [B, W, H]
        rows = np.concatenate([np.arange(bounds[w], bounds[w + 1]) for w in picked])
        which = np.concatenate([np.full(bounds[w + 1] - bounds[w], j) for j, w in enumerate(picked)])
        yield rows, states[which, positions[rows] - start[rows]]


def _rows(
    states: np.ndarray,
    positions: np.ndarray,
    tokens: np.ndarray,
    offsets: np.ndarray,
    options: DenseOptions,
    projection: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> Iterator[tuple[np.ndarray, list[int]]]:
    """Yield (unit vector [D], the continuation after its position within its document) per sampled position."""
    mean, scale, components = projection
    ends = offsets[np.searchsorted(offsets, positions, side="right")]  # [S] end of each position's document
    for lo in range(0, positions.shape[0], _CHUNK_ROWS):
        vectors = dense_db.project(states[lo : lo + _CHUNK_ROWS], mean=mean, scale=scale, components=components)
        for j, vector in enumerate(vectors):
            at = int(positions[lo + j])
            stop = min(at + 1 + options.continuation, int(ends[lo + j]))
            yield vector, tokens[at + 1 : stop].tolist()


@contextmanager
def _scratch() -> Iterator[Path]:
    """Yield a scratch directory that a later ingest removes if this process dies (named like its work dirs)."""
    root = crest_home() / "work"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"ingest-{os.getpid()}-dense-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
