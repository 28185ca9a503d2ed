"""Commands that only read never migrate: a fresh database, a schema behind this crest's, a read-only role and a
read-only session (what a replica gives) each get one clean line, and nothing is created or changed.

`crest lookup`, `stores`, `db query` and `export` check the schema's revision instead of running the migrations
(`crest.cli.store_commands.read_database`); `ingest` and `drop`, which write, still migrate.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from crest.config import IngestOptions
from crest.db.connection import head_revision, schema_revision, upgrade
from crest.db.roles import create_roles
from crest.errors import EXIT_DATABASE, EXIT_FAILURE
from crest.ingest.pipeline import ingest
from tests.fix_cli import one_error_line, run
from tests.fix_store import write_corpus

pytest_plugins = ["tests.fix_corpus"]

BEHIND = "0006"  # a revision this crest migrates past

READERS = [
    ("lookup", ["lookup", "--store", "s", "x"], r"no published store named 's'"),
    ("stores", ["stores"], r"no store"),
    ("query", ["db", "query", "coverage"], r"no store"),
    ("export", ["export", "{out}", "--store", "s"], r"no published store named 's'"),
]


def _args(args: list[str], tmp_path: Path) -> list[str]:
    return [str(tmp_path / "out.bin") if a == "{out}" else a for a in args]


def _read_only(dsn: str) -> str:
    """Return `dsn` with every transaction read-only, as on a replica."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["options"] = "-c default_transaction_read_only=on"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


@pytest.mark.parametrize(("args", "says"), [r[1:] for r in READERS], ids=[r[0] for r in READERS])
def test_a_read_command_neither_creates_nor_migrates_the_schema(
    empty_db: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    says: str,
) -> None:
    args = _args(args, tmp_path)
    code, out, err = run(monkeypatch, capsys, *args, "--dsn", empty_db)
    line = one_error_line(err)
    assert code == EXIT_FAILURE and out == "" and "no crest schema" in line, err
    assert re.search(says, line), line
    assert schema_revision(empty_db) is None  # nothing was created
    upgrade(empty_db, revision=BEHIND)
    code, out, err = run(monkeypatch, capsys, *args, "--dsn", empty_db)
    line = one_error_line(err)
    assert code == EXIT_DATABASE and f"revision {BEHIND}" in line and "crest db upgrade" in line, err
    assert schema_revision(empty_db) == BEHIND != head_revision()  # said, not migrated


def test_a_read_only_session_is_told_there_is_no_schema(
    empty_db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replica cannot be migrated: the read command says what is missing instead of failing to write."""
    code, _, err = run(monkeypatch, capsys, "lookup", "--store", "s", "x", "--dsn", _read_only(empty_db))
    line = one_error_line(err)
    assert code == EXIT_FAILURE and "no published store named 's'" in line and "no crest schema" in line, err


@pytest.fixture()
def reader(db_dsn: str) -> Iterator[tuple[str, str]]:
    """Yield (admin DSN, a read-only role's DSN) of one database, the role made by `crest db roles`'s code."""
    tag = uuid.uuid4().hex[:8]
    role, writer, password = f"crest_r_{tag}", f"crest_w_{tag}", uuid.uuid4().hex
    info = psycopg.conninfo.conninfo_to_dict(db_dsn) | {"user": role, "password": password}
    yield db_dsn, psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # roles are cluster-wide: remove them
        for name in (role, writer):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_a_read_only_role_reads_and_is_told_when_the_schema_is_behind(
    reader: tuple[str, str],
    word_tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    admin, reader_dsn = reader
    corpus = write_corpus(tmp_path / "c.jsonl", ["the cat sat on the mat"] * 20)
    options = IngestOptions(top_t=50, max_n=3)
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=admin, options=options)
    info = psycopg.conninfo.conninfo_to_dict(reader_dsn)
    role, password = str(info["user"]), str(info["password"])
    create_roles(admin, reader=role, writer=role.replace("_r_", "_w_"), reader_password=password)
    for dsn in (reader_dsn, _read_only(reader_dsn)):
        code, out, err = run(monkeypatch, capsys, "lookup", "--store", "words", "the cat sat on", "--dsn", dsn)
        assert code == 0 and "matched suffix" in out, (out, err)
        code, out, err = run(monkeypatch, capsys, "stores", "--dsn", dsn)
        assert code == 0 and "words" in out, err
    with psycopg.connect(admin, autocommit=True) as conn:  # as if this crest were newer than the database
        conn.execute("UPDATE crest_alembic_version SET version_num = %s", (BEHIND,))
    code, _, err = run(monkeypatch, capsys, "stores", "--dsn", reader_dsn)
    line = one_error_line(err)
    assert code == EXIT_DATABASE and f"revision {BEHIND}" in line and "crest db upgrade" in line, err
