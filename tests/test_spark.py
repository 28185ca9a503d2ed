"""The Spark engine publishes the same store as the in-process engine, whatever the partitioning, and a job that
fails leaves the published version alone. Needs pyspark (`pip install 'crest[spark]'`) and Java; skipped without
(a failure when `CREST_TESTS_REQUIRE` names spark).
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from crest.config import IngestOptions
from crest.errors import ConfigError, CorpusError, CrestError
from crest.ingest.pipeline import ingest
from crest.ingest.spark_tasks import (
    Sample,
    bottom_k,
    merge_counts,
    merge_samples,
    rank_offsets,
    ranks_of,
    sample_groups,
    split_by_bounds,
)
from crest.ingest.trees import position_hash
from tests.fix_corpus import CONVERSATIONS, make_word_tokenizer, write_jsonl, write_sharegpt
from tests.fix_judged import CHOICE_WORDS, choice_options, word_corpus, word_phrases, write_words
from tests.fix_require import require, require_module

require_module("spark", "pyspark", "the spark engine needs pyspark: pip install 'crest[spark]'")
if shutil.which("java") is None:
    require("spark", "the spark engine needs a Java runtime (java on PATH)")

from crest.ingest.disk import FIRST_BLOCK  # noqa: E402
from crest.ingest.spark import ingest_spark, spark_session  # noqa: E402
from crest.ingest.spark_load import ENV_FAULT  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "colorsys.py", "keyword.py"]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A slice of Python's standard library (~150 KB) as files, a JSONL file and a ShareGPT file."""
    root = tmp_path_factory.mktemp("corpus")
    code = root / "code"
    code.mkdir()
    for name in SOURCES:
        shutil.copy(STDLIB / name, code / name)
    texts = [(STDLIB / "json" / n).read_text() for n in ("decoder.py", "encoder.py", "scanner.py")]
    records = [{"text": t} for t in texts] + [{"messages": [{"role": "user", "content": t[:2000]}]} for t in texts]
    jsonl = write_jsonl(root / "more.jsonl", records)
    chats = write_sharegpt(root / "chats.json", CONVERSATIONS * 20)
    return [str(code), str(jsonl), str(chats)]


def rows_of(dsn: str, store_id: int) -> tuple[list[tuple[Any, ...]], tuple[Any, ...], int]:
    """Return a version's (n, key, count, tree) rows sorted, its token table and key filter, its vocabulary size."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT n, key, count, tree FROM crest_ngrams WHERE store_id = %s ORDER BY n, key", (store_id,)
        ).fetchall()
        data = conn.execute(
            "SELECT token_table, key_filter FROM crest_store_data WHERE store_id = %s", (store_id,)
        ).fetchone()
        vocab = conn.execute("SELECT count(*), min(token_id) FROM crest_vocab WHERE store_id = %s", (store_id,))
        count, lowest = vocab.fetchone() or (0, None)
    assert data is not None and lowest == 0
    return [tuple(bytes(c) if isinstance(c, memoryview) else c for c in r) for r in rows], tuple(data), int(count)


OPTIONS = {
    "top-t, sampled": IngestOptions(top_t=700, max_matches=7, suffix_rule="lookup"),
    "budget, two blocks": IngestOptions(budget=2_600_000, max_matches=30, tree_size=16, suffix_rule="lookup"),
    "single n": IngestOptions(top_t=300, selection="single", single_n=3, max_n=3, blob_format=1),
    "top-t, pruned": IngestOptions(top_t=700, max_matches=7, suffix_rule="prune"),
    "budget, pruned": IngestOptions(budget=800_000, max_matches=30, tree_size=16, suffix_rule="prune"),  # kept rows
}


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_same_rows_as_in_process(
    db_dsn: str, spark: Any, corpus: list[str], smollm2_gguf: Path, options: IngestOptions
) -> None:
    want = ingest(corpus, store="local", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=options)
    expected = rows_of(db_dsn, want.store_id)
    assert len(expected[0]) > 100
    assert options.budget is None or FIRST_BLOCK < (want.top_t or 0) < 3 * FIRST_BLOCK  # the budget ends in block 2
    for partitions in (1, 2, 3):
        got = ingest_spark(
            corpus,
            store=f"spark{partitions}",
            tokenizer=str(smollm2_gguf),
            dsn=db_dsn,
            options=options,
            spark=spark,
            partitions=partitions,
        )
        assert rows_of(db_dsn, got.store_id) == expected, f"{partitions} partition(s)"
        assert (got.tokens, got.documents, got.counted, got.kept, got.covered, got.top_t) == (
            want.tokens,
            want.documents,
            want.counted,
            want.kept,
            want.covered,
            want.top_t,
        )
        assert got.positions == want.positions and got.spark["partitions"] == partitions
        assert (got.blob_bytes, got.avg_tree_nodes) == (want.blob_bytes, want.avg_tree_nodes)
    if options.suffix_rule == "prune" and options.selection == "combined":  # the comparison covers pruning
        assert all(want.kept[n] < want.counted[n] and want.kept[n] < (want.top_t or 0) for n in (2, 3, 4))


# the judge decides as in process (tests/test_suffix_choice.py): Zipf noise follows `expected`, so prune; the
# corpus's phrases in new orders follow the long n-grams' thin trees, so every row is kept
@pytest.mark.slow
@pytest.mark.parametrize(
    ("judge_share", "want"), [(0.0, "prune"), (1.0, "longest")], ids=["noise-judge", "phrase-judge"]
)
def test_auto_on_a_judge_chooses_and_builds_as_in_process(
    db_dsn: str, spark: Any, tmp_path: Path, judge_share: float, want: str
) -> None:
    tokenizer = str(make_word_tokenizer(tmp_path / "tok", CHOICE_WORDS))
    rng = np.random.default_rng(0)
    phrases = word_phrases(rng)
    corpus = [str(write_words(tmp_path / "corpus.jsonl", *word_corpus(rng, phrases, 0.5, 300)))]
    judge = [
        str(write_words(tmp_path / "judge.jsonl", *word_corpus(np.random.default_rng(7), phrases, judge_share, 40)))
    ]
    options = choice_options(0, "auto")
    local = ingest(corpus, store="local", tokenizer=tokenizer, dsn=db_dsn, options=options, judge=judge)
    assert local.suffix_choice is not None and local.suffix_choice["rule"] == want and local.suffix_choice["novel"]
    expected = rows_of(db_dsn, local.store_id)
    for partitions in (1, 3):
        got = ingest_spark(
            corpus,
            store=f"spark{partitions}",
            tokenizer=tokenizer,
            dsn=db_dsn,
            options=options,
            spark=spark,
            partitions=partitions,
            judge=judge,
        )
        assert got.suffix_choice == local.suffix_choice, f"{partitions} partition(s)"
        assert rows_of(db_dsn, got.store_id) == expected, f"{partitions} partition(s)"
        assert (got.kept, got.blob_bytes) == (local.kept, local.blob_bytes)
        with psycopg.connect(db_dsn) as conn:
            row = conn.execute("SELECT figures FROM crest_stores WHERE id = %s", (got.store_id,)).fetchone()
        assert row is not None and row[0]["suffix_choice"] == local.suffix_choice


def test_auto_without_a_judge_is_refused_before_any_work(db_dsn: str, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a b c"}])
    with pytest.raises(ConfigError, match="--engine spark chooses --suffix-rule auto on --suffix-judge only"):
        ingest_spark(
            [str(corpus)],
            store="s",
            tokenizer="no-such-tokenizer",
            dsn=db_dsn,
            options=IngestOptions(suffix_rule="auto"),
        )
    with pytest.raises(ConfigError, match="--suffix-judge is the text --suffix-rule auto chooses its rule on"):
        ingest_spark(
            [str(corpus)],
            store="s",
            tokenizer="no-such-tokenizer",
            dsn=db_dsn,
            options=IngestOptions(),
            judge=[str(corpus)],
        )
    with pytest.raises(ConfigError, match="--engine spark cannot fill --budget under --suffix-rule auto"):
        ingest_spark(
            [str(corpus)],
            store="s",
            tokenizer="no-such-tokenizer",
            dsn=db_dsn,
            options=IngestOptions(suffix_rule="auto", budget=1 << 20),
            judge=[str(corpus)],
        )
    with psycopg.connect(db_dsn) as conn:
        built = conn.execute("SELECT to_regclass('crest_stores') IS NOT NULL").fetchone() == (True,)
        assert not built or conn.execute("SELECT count(*) FROM crest_stores").fetchone() == (0,)


@pytest.mark.slow
def test_failed_job_leaves_published_version(
    db_dsn: str, spark: Any, corpus: list[str], smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = IngestOptions(top_t=200)
    first = ingest_spark(
        corpus, store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=options, spark=spark, partitions=2
    )
    before = rows_of(db_dsn, first.store_id)
    monkeypatch.setenv(ENV_FAULT, "copy")
    with pytest.raises(CrestError, match="fault injected"):
        ingest_spark(
            corpus, store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=options, spark=spark, partitions=2
        )
    monkeypatch.delenv(ENV_FAULT)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n{"text": "never read"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl' line 2 is not valid JSON"):
        ingest_spark(
            [*corpus, str(bad)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=options, spark=spark
        )
    with psycopg.connect(db_dsn) as conn:
        states = conn.execute("SELECT id, state FROM crest_stores WHERE name = 'code' ORDER BY id").fetchall()
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'crest_ngrams_s%'").fetchone()
    assert states == [(first.store_id, "published")]  # the failed build was cleaned up
    assert tables == (1,)
    assert rows_of(db_dsn, first.store_id) == before


@pytest.mark.slow
def test_parquet_input(db_dsn: str, spark: Any, smollm2_gguf: Path, tmp_path: Path) -> None:
    texts = [(STDLIB / name).read_text() for name in SOURCES[:4]]
    frame = spark.createDataFrame([{"text": t} for t in texts])
    frame.coalesce(1).write.parquet(str(tmp_path / "docs.parquet"))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    options = IngestOptions(top_t=300)
    want = ingest([str(jsonl)], store="local", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=options)
    got = ingest_spark(
        [str(tmp_path / "docs.parquet")],
        store="pq",
        tokenizer=str(smollm2_gguf),
        dsn=db_dsn,
        options=options,
        spark=spark,
    )
    assert got.documents == len(texts)
    assert rows_of(db_dsn, got.store_id) == rows_of(db_dsn, want.store_id)


def test_merge_counts_adds_shared_keys() -> None:
    a = (np.array([1, 4, 9], np.uint64), np.array([1, 2, 3], np.int64))
    b = (np.array([4, 5], np.uint64), np.array([10, 1], np.int64))
    keys, counts = merge_counts(a, b)
    assert keys.tolist() == [1, 4, 5, 9] and counts.tolist() == [1, 12, 1, 3]


@pytest.mark.parametrize("buckets", [1, 2, 5], ids=["one range", "two ranges", "five ranges"])
def test_ranks_match_count_then_key_order(buckets: int) -> None:
    rng = np.random.default_rng(buckets)
    keys = np.unique(rng.integers(0, 10_000, 500).astype(np.uint64))
    counts = np.asarray(rng.integers(1, 6, keys.shape[0]), dtype=np.int64)  # many ties
    bounds = np.sort(rng.choice(keys, buckets - 1, replace=False)) if buckets > 1 else None
    tables = dict(split_by_bounds(keys, counts, bounds))
    offsets = rank_offsets({b: np.unique(c, return_counts=True) for b, (_, c) in tables.items()})
    got = np.concatenate([ranks_of(c, offsets[b]) for b, (_, c) in sorted(tables.items())])
    want = np.empty(keys.shape[0], np.int64)
    want[np.lexsort((keys, -counts))] = np.arange(keys.shape[0])
    assert got.tolist() == want.tolist()


def test_sample_merge_is_the_bottom_k_of_all() -> None:
    rng = np.random.default_rng(0)
    ngram = rng.integers(0, 5, 300).astype(np.int64)
    pos = rng.permutation(10_000)[:300].astype(np.int64)

    def sample(m: np.ndarray) -> Sample:
        return Sample(
            ngram[m], position_hash(pos[m], 3), pos[m], pos[m, None].astype(np.int32), np.ones(m.sum(), np.int32)
        )

    half = np.arange(300) < 130
    merged = merge_samples(bottom_k(sample(half), 8), bottom_k(sample(~half), 8), 8)
    whole = bottom_k(sample(np.ones(300, bool)), 8)
    assert merged.position.tolist() == whole.position.tolist()
    assert np.bincount(merged.ngram).tolist() == [8] * 5


def test_sample_groups_bound_the_bytes_of_a_group() -> None:
    counts = np.array([10_000, 1, 1, 6000, 3, 2, 9000, 1], np.int64)
    edges = sample_groups(counts, max_matches=5000, length=10, groups=2, group_bytes=5000 * 68)
    assert edges[0] == 0 and np.all(np.diff(edges) > 0)
    planned = np.minimum(counts, 5000) * 68
    sizes = [int(planned[a:b].sum()) for a, b in zip(edges, [*edges[1:], counts.shape[0]], strict=True)]
    assert len(edges) >= 3 and max(sizes) <= 2 * 5000 * 68


@pytest.mark.slow  # starts Spark (a JVM) for this one test in the fast lane
def test_missing_input_fails_before_any_work(db_dsn: str, spark: Any, tmp_path: Path, smollm2_gguf: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        ingest_spark(
            [str(tmp_path / "nope.jsonl")],
            store="x",
            tokenizer=str(smollm2_gguf),
            dsn=db_dsn,
            options=IngestOptions(top_t=10),
            spark=spark,
        )
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM crest_stores").fetchone() == (0,)


@pytest.mark.slow
def test_cli_engine_spark(db_dsn: str, tmp_path: Path, smollm2_gguf: Path) -> None:
    from tests.fix_cli import run_cli

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": (STDLIB / "bisect.py").read_text()}])
    out = run_cli(
        "ingest", str(corpus), "-s", "cli", "-t", str(smollm2_gguf), "--top-t", "50", "-q",
        "--engine", "spark", "--spark-master", "local[1]", "--spark-partitions", "2",
        dsn=db_dsn,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT figures FROM crest_stores WHERE name = 'cli' AND state = 'published'").fetchone()
    assert row is not None and row[0]["spark"]["partitions"] == 2
    bad = run_cli("ingest", str(corpus), "-s", "cli", "-t", str(smollm2_gguf), "--engine", "nope", dsn=db_dsn)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    json.dumps(row[0])


@pytest.mark.parametrize("keep", ["savings", "marginal"])
def test_keep_other_than_count_is_refused_before_any_work(db_dsn: str, tmp_path: Path, keep: str) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a b c"}])
    options = IngestOptions(top_t=5, keep=keep)
    with pytest.raises(ConfigError, match=f"--engine spark keeps n-grams by count only, not by '{keep}'"):
        ingest_spark([str(corpus)], store="s", tokenizer="no-such-tokenizer", dsn=db_dsn, options=options)
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM crest_stores").fetchone() == (0,)  # no version begun
