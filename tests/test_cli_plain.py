"""Output for scripts: what `crest stores`, `crest db query`, `crest db queries` and `crest lookup` print to a pipe
(CliRunner's output is not a terminal) has one shape at any width: a title, a header line and one line per row, no
line wrapped or cut, columns aligned however long a name is.
"""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from crest.cli.app import app
from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from tests.fix_store import ROWS, publish, write_corpus

pytest_plugins = ["tests.fix_corpus"]

LONG = "a_store_with_a_long_descriptive_name"


def piped(*args: str, columns: int, dsn: str | None = None) -> str:
    """Return what `crest ARGS` writes to a pipe when the terminal would be `columns` wide."""
    env = {"COLUMNS": str(columns), **({"CREST_DATABASE_URL": dsn} if dsn else {})}
    done = CliRunner().invoke(app, list(args), env=env)
    assert done.exit_code == 0, done.output
    return done.stdout


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_stores_are_one_line_each_at_any_width(db_dsn: str) -> None:
    for name in ("stdlib", LONG):
        publish(db_dsn, name, ROWS)
    for extra in ([], ["--all"]):
        narrow = piped("stores", *extra, columns=40, dsn=db_dsn)
        assert narrow == piped("stores", *extra, columns=300, dsn=db_dsn)  # the width of no terminal matters
        title, header, *rows = narrow.splitlines()
        columns = cells(header)
        assert title == "crest stores", narrow
        assert columns[:3] == ["store", "version", "tier"] and ("state" in columns) == bool(extra), narrow
        assert [cells(row)[0] for row in rows] == sorted(["stdlib", LONG]), narrow  # one line per store
        assert all(len(cells(row)) == len(columns) for row in rows), narrow
        last = header.rindex(columns[-1])  # the publication time: text, left-aligned under its name
        assert all(row[last - 1] == " " and row[last] != " " for row in rows), narrow
        assert all(line == line.rstrip() for line in narrow.splitlines()), narrow


def test_db_query_is_a_plain_table_at_any_width(db_dsn: str, tmp_path: Path) -> None:
    for name in ("stdlib", LONG):
        publish(db_dsn, name, ROWS)
    own = tmp_path / "mine.sql"
    own.write_text(
        "-- Store names.\nSELECT name AS store, id AS version, 'x' AS note FROM crest_stores ORDER BY name\n"
    )
    narrow = piped("db", "query", str(own), "--dsn", db_dsn, columns=20)
    assert narrow == piped("db", "query", str(own), "--dsn", db_dsn, columns=300)
    title, header, *rows = narrow.splitlines()
    assert title == "Store names"
    assert cells(header) == ["store", "version", "note"] and len(rows) == 2, narrow
    assert [cells(row)[0] for row in rows] == [LONG, "stdlib"] and all(len(cells(row)) == 3 for row in rows), narrow
    assert len({line.index("note" if line is header else "x") for line in (header, *rows)}) == 1, narrow


def test_db_queries_align_every_summary() -> None:
    for args in (["db", "queries"], ["db", "query", "--list"]):
        listed = piped(*args, columns=40).splitlines()
        starts = {len(re.match(r"\S+\s+", line).group(0)) for line in listed}  # type: ignore[union-attr]
        assert len(listed) > 1 and len(starts) == 1, listed  # `live_acceptance`'s summary starts where `dense`'s does


def test_lookup_header_is_never_wrapped(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", ["dog on mat"] * 150 + ["the cat sat on a"])
    options = IngestOptions(suffix_rule="lookup")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)
    args = ("lookup", "--store", "words", "the cat sat on", "--rule", "longest")
    narrow = piped(*args, columns=40, dsn=db_dsn)
    assert narrow == piped(*args, columns=300, dsn=db_dsn)
    first, second = narrow.splitlines()[:2]
    assert first.startswith("matched suffix 'the' 'cat' 'sat' 'on' (4 token(s), rule longest)"), narrow
    assert first.endswith("node: text (id, weight)") and second.startswith("tree: "), narrow
