"""The check, prologue and epilogue both ingest engines share: what each engine refuses, what a failed build leaves."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from crest.config import KEEP_RULES, IngestOptions
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from crest.ingest.publishing import check_ingest
from tests.fix_corpus import WORDS, write_jsonl

pytest_plugins = ["tests.fix_corpus"]


@pytest.mark.parametrize("keep", KEEP_RULES)
@pytest.mark.parametrize("engine", ["inprocess", "spark"])
def test_each_engine_takes_only_the_keep_rules_it_implements(engine: str, keep: str) -> None:
    options = IngestOptions(top_t=5, keep=keep)
    if engine == "spark" and keep != "count":
        with pytest.raises(ConfigError, match=f"--engine spark keeps n-grams by count only, not by '{keep}'"):
            check_ingest(options, store="s", engine=engine)
    else:
        assert check_ingest(options, store="s", engine=engine).keep == keep


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": "flink"}, "unknown --engine 'flink'"),
        ({"chunk_tokens": 0}, "--chunk-tokens must be positive"),
        ({"partitions": 0}, "--spark-partitions must be positive"),
    ],
    ids=["engine", "chunk-tokens", "partitions"],
)
def test_bad_engine_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"store": "s", **kwargs}
    with pytest.raises(ConfigError, match=message):
        check_ingest(IngestOptions(), **args)  # type: ignore[arg-type]


def test_defaults_filled_in() -> None:
    assert check_ingest(IngestOptions(), store="s").top_t is not None
    assert check_ingest(IngestOptions(budget=1000), store="s").top_t is None


def versions(dsn: str, store: str) -> list[tuple[str, dict[str, object]]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT state, params FROM crest_stores WHERE name = %s ORDER BY id", (store,)).fetchall()
    return [(state, params) for state, params in rows]


def test_in_process_engine_keeps_by_savings(db_dsn: str, tmp_path: Path, word_tokenizer_dir: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(WORDS[i:] + WORDS[:i])} for i in range(7)] * 3)
    options = IngestOptions(max_n=2, top_t=3, keep="savings")
    summary = ingest([str(corpus)], store="w", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)
    assert 0 < summary.rows <= 2 * 3
    [(state, params)] = versions(db_dsn, "w")
    assert state == "published" and params["keep"] == "savings"


def test_failed_build_is_marked_failed_and_published_version_stays(
    db_dsn: str, tmp_path: Path, word_tokenizer_dir: Path
) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(WORDS)}] * 3)
    tok = str(word_tokenizer_dir)
    ingest([str(corpus)], store="w", tokenizer=tok, dsn=db_dsn, options=IngestOptions(top_t=3))
    with pytest.raises(ConfigError, match="nothing to store"):  # raised inside the build, before publishing
        ingest([str(corpus)], store="w", tokenizer=tok, dsn=db_dsn, options=IngestOptions(budget=1))
    assert [state for state, _ in versions(db_dsn, "w")] == ["published", "failed"]
