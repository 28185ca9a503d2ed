"""What both ingest engines share around their stages: one option check, one prologue and one epilogue.

The in-process engine (`crest.ingest.pipeline`) and the Spark engine (`crest.ingest.spark`) differ only in how
they read, count and load. Both call `check_ingest` first (the options validated with their defaults, the engine's
own limits: Spark keeps n-grams by count only, so `--keep savings|marginal` is refused there, not silently
ignored), run inside `prepared` (the database migrated, what killed builds left removed before and after), build
inside `building` (the version begun with its vocabulary, failed on any error, closed) and end with
`publish_summary`. `IngestSummary` is what an ingest did; `Vocabulary` what a version records of its tokenizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from crest_client.codec import token_width

from crest import db
from crest.config import KEEP_RULES, IngestOptions, check_store_name
from crest.decoding.tokenizer import Tokenizer
from crest.errors import ConfigError

# Corpus positions scanned at once when counting and finding occurrences (occurrences gathered at once: 4x, trie
# batches: 1/4): peak memory follows this and the number of distinct n-grams, not the corpus size
# (`--chunk-tokens`, CREST_CHUNK_TOKENS).
CHUNK_TOKENS = 1 << 22
ENGINES = ("inprocess", "spark")
ENGINE_KEEP_RULES = {"inprocess": KEEP_RULES, "spark": ("count",)}  # the keep rules each engine implements


@dataclass
class IngestSummary:
    """What an ingest did, printed by the CLI and recorded in the store's `figures`."""

    store: str
    store_id: int
    documents: int
    empty_documents: int
    dropped_records: int
    drop_reasons: list[str]
    tokens: int
    counted: dict[int, int]
    kept: dict[int, int]
    positions: dict[int, int]
    covered: dict[int, int]
    avg_tree_nodes: float
    blob_bytes: int
    table_bytes: int
    index_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    top_t: int | None = None
    suffix_choice: dict[str, Any] | None = None  # `--suffix-rule auto`: crest.ingest.suffix_choice.Choice

    @property
    def rows(self) -> int:
        return sum(self.kept.values())

    @property
    def bytes_per_ngram(self) -> float:
        return (self.table_bytes + self.index_bytes) / max(1, self.rows)

    def to_figures(self) -> dict[str, Any]:
        """Return the summary as JSON-ready figures."""
        out = asdict(self)
        for key in ("counted", "kept", "positions", "covered"):
            out[key] = {str(k): v for k, v in out[key].items()}
        out["bytes_per_ngram"] = round(self.bytes_per_ngram, 1)
        return out


@dataclass(frozen=True)
class Vocabulary:
    """What a version records of its tokenizer: where it loads from, its fingerprint, size and text pieces."""

    spec: str
    fingerprint: str
    size: int
    pieces: Callable[[], Iterable[tuple[int, str]]]  # (id, text), for SQL rendering

    @classmethod
    def of(cls, tok: Tokenizer, spec: str) -> Vocabulary:
        """Return the vocabulary of a loaded tokenizer (`spec`: the path or name it was loaded from)."""
        recorded = str(Path(spec).resolve()) if Path(spec).exists() else str(spec)
        return cls(recorded, tok.fingerprint, tok.vocab_size, tok.pieces)


def check_ingest(
    options: IngestOptions,
    *,
    store: str,
    engine: str = "inprocess",
    chunk_tokens: int = CHUNK_TOKENS,
    partitions: int | None = None,
) -> IngestOptions:
    """Return the options validated, with their defaults, or raise ConfigError naming the first bad value."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown --engine {engine!r}: use {' or '.join(ENGINES)}")
    options = options.validate().with_defaults()
    if options.keep not in ENGINE_KEEP_RULES[engine]:
        raise ConfigError(
            f"--engine {engine} keeps n-grams by {' or '.join(ENGINE_KEEP_RULES[engine])} only, not by "
            f"{options.keep!r}: use --keep count or --engine inprocess"
        )
    if engine == "spark" and options.suffix_rule == "backoff":  # back-off trees are built in process only
        raise ConfigError(
            "--engine spark stores each n-gram's own tree only, not --suffix-rule backoff: "
            "use --suffix-rule lookup, prune or auto, or --engine inprocess"
        )
    if chunk_tokens < 1:
        raise ConfigError(f"--chunk-tokens must be positive, got {chunk_tokens}")
    if partitions is not None and partitions < 1:
        raise ConfigError(f"--spark-partitions must be positive, got {partitions}")
    check_store_name(store)
    return options


def check_judge(options: IngestOptions, *, judged: bool, engine: str = "inprocess") -> None:
    """Raise ConfigError unless a judge corpus comes with `--suffix-rule auto` (on Spark: needed, and no budget)."""
    if judged and options.suffix_rule != "auto":
        raise ConfigError("--suffix-judge is the text --suffix-rule auto chooses its rule on: give --suffix-rule auto")
    if engine == "spark" and options.suffix_rule == "auto" and options.budget is not None:
        raise ConfigError(  # which rows fill a budget depends on the rule: chosen first, on a trial build in process
            "--engine spark cannot fill --budget under --suffix-rule auto (its rows depend on the rule chosen): give "
            "--suffix-rule prune or lookup with --budget, --top-t with auto, or --engine inprocess"
        )
    if engine == "spark" and options.suffix_rule == "auto" and not judged:  # no trial build on Spark
        raise ConfigError(
            "--engine spark chooses --suffix-rule auto on --suffix-judge only (the held-out trial build runs in "
            "process): give --suffix-judge FILE (best the model's own answers), or --engine inprocess"
        )


@contextmanager
def prepared(dsn: str) -> Iterator[None]:
    """Migrate the database and remove what killed builds left, before the body and again once it succeeded."""
    db.upgrade(dsn)
    with db.session(dsn) as conn:
        db.clean_leftovers(conn)
    yield
    with db.session(dsn) as conn:
        db.clean_leftovers(conn)


@contextmanager
def building(
    dsn: str,
    store: str,
    *,
    vocabulary: Vocabulary,
    options: IngestOptions,
    params: dict[str, Any] | None = None,
    tier: str = "static",
) -> Iterator[db.Build]:
    """Begin a version of `store` with its vocabulary written; fail it on any error (the published one stays)."""
    build = db.begin_build(
        dsn,
        store,
        fingerprint=vocabulary.fingerprint,
        tokenizer=vocabulary.spec,
        vocab_size=vocabulary.size,
        token_width=token_width(vocabulary.size),
        params={**asdict(options), **(params or {})},
        tier=tier,
    )
    try:
        build.copy_vocab(vocabulary.pieces())
        yield build
    except BaseException:
        build.fail()
        raise
    finally:
        build.close()


def publish_summary(
    build: db.Build, summary: IngestSummary, *, seconds: dict[str, float], started: float, allow_empty: bool = False
) -> None:
    """Publish the build with the summary's figures (refusing an empty store), then record time and peak memory."""
    if summary.rows == 0 and not allow_empty:
        if summary.top_t == 0 and any(summary.counted.values()):  # --budget reached no rank at all
            raise ConfigError(
                "nothing to store: the budget is too small for even one n-gram per n (a version takes 80 kB or more "
                "on disk before its first row: its token table, its table's maps and its hash index's first pages)"
            )
        raise ConfigError(
            f"nothing to store: the corpus ({summary.documents} documents, {summary.tokens} tokens) has no n-gram "
            "that is followed by a token often enough to keep; give a larger corpus"
        )
    build.publish(summary.to_figures())
    seconds["index_publish"] = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss()
    build.set_figures(summary.to_figures())


def peak_rss() -> int:
    """Return this process's peak resident memory in bytes."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
