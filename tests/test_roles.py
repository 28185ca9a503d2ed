"""Least privilege on a real PostgreSQL: the writer ingests, the reader drafts and is refused everything else.

The reader may INSERT crest_learned's data columns, the learned row's figures included, and no other column;
migration 0004 adds those figures, hands them to the roles that could append rows before, and goes back down;
migration 0005 moves the per-part figures into one jsonb column (rows, grants and back down included).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest
from crest_client import Store
from psycopg import sql
from typer.testing import CliRunner

from crest.cli.app import app
from crest.config import IngestOptions
from crest.db import upgrade
from crest.db.roles import LEARNED_DENSE, LEARNED_INSERT_COLUMNS, create_roles
from crest.db.schema import learned
from crest.decoding.tokenizer import load_tokenizer
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from tests.fix_require import require

pytest_plugins = ["tests.fix_corpus"]

SQL = Path(__file__).resolve().parent.parent / "sql"
TEXT = "the cat sat on the mat . a dog sat on the mat . the cat sat on a dog .\n"


def _as(dsn: str, user: str, password: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info.update(user=user, password=password)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


class Roles:
    """Names and DSNs of one test's reader and writer."""

    def __init__(self, admin: str) -> None:
        tag = uuid.uuid4().hex[:8]
        self.admin = admin
        self.reader, self.writer = f"crest_r_{tag}", f"crest_w_{tag}"
        self.password = uuid.uuid4().hex
        self.reader_dsn = _as(admin, self.reader, self.password)
        self.writer_dsn = _as(admin, self.writer, self.password)


@pytest.fixture()
def roles(db_dsn: str) -> Iterator[Roles]:
    made = Roles(db_dsn)
    yield made
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # roles are cluster-wide: remove them
        for role in (made.reader, made.writer):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "c.txt"
    path.write_text(TEXT * 5)
    return path


def _ingest(dsn: str, corpus: Path, store: str, tokenizer: Path) -> int:
    options = IngestOptions(top_t=50, max_n=3)
    return ingest([str(corpus)], store=store, tokenizer=str(tokenizer), dsn=dsn, options=options).store_id


def _need_psql() -> None:
    if shutil.which("psql") is None:
        require("psql", "psql is not installed")


def _refused(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)


def test_cli_roles_reader_drafts_writer_ingests(
    roles: Roles, corpus: Path, word_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _ingest(roles.admin, corpus, "early", word_tokenizer_dir)  # built before the roles existed
    monkeypatch.setenv("CREST_TEST_ROLE_PASSWORD", roles.password)
    args = ["db", "roles", "--reader", roles.reader, "--writer", roles.writer, "--dsn", roles.admin]
    args += ["--reader-password-env", "CREST_TEST_ROLE_PASSWORD", "--writer-password-env", "CREST_TEST_ROLE_PASSWORD"]
    for _ in range(2):  # idempotent
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 0, done.output
    assert "created" not in done.output

    again = _ingest(roles.writer_dsn, corpus, "early", word_tokenizer_dir)  # drops the admin's old version
    new = _ingest(roles.writer_dsn, corpus, "late", word_tokenizer_dir)
    with psycopg.connect(roles.admin) as conn:
        assert conn.execute("SELECT to_regclass(%s)", (f"crest_ngrams_s{old}",)).fetchone() == (None,)
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class WHERE relname LIKE 'crest\\_%%'"
            " AND relkind IN ('r', 'p')"
        ).fetchall()
    assert owners == [(roles.writer,)]

    ids = load_tokenizer(word_tokenizer_dir).encode("a dog sat on")
    for name in ("early", "late"):
        with Store.connect(roles.reader_dsn, name, cache_size=0, timeout=5.0) as store:
            draft = store.draft(ids)
            assert draft is not None and draft.n >= 2
            assert store.stats["errors"] == 0
    with psycopg.connect(roles.reader_dsn) as conn:  # every crest table, later ones included
        unreadable = conn.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE 'crest\\_%%' AND relkind IN ('r', 'p')"
            " AND NOT has_table_privilege(oid, 'SELECT')"
        ).fetchall()
        assert unreadable == []
        assert conn.execute("SELECT count(*) FROM crest_stores WHERE state = 'published'").fetchone() == (2,)
        conn.execute("SELECT count(*) FROM crest_ngrams").fetchone()

    with psycopg.connect(roles.admin, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA private")
        conn.execute("CREATE TABLE private.secret (x int)")
        conn.execute("CREATE TABLE public.other (x int)")
    part = f"crest_ngrams_s{new}"
    for statement in (
        "INSERT INTO crest_stores (name, state, tokenizer_fingerprint, vocab_size, token_width)"
        " VALUES ('x', 'building', 'f', 1, 1)",
        "UPDATE crest_stores SET state = 'retired'",
        "DELETE FROM crest_stores",
        f"DELETE FROM {part}",
        f"UPDATE {part} SET count = 0",
        f"TRUNCATE {part}",
        f"DROP TABLE {part}",
        "DROP TABLE crest_stores",
        f"ALTER TABLE {part} ADD COLUMN x int",
        "CREATE TABLE public.mine (x int)",
        "CREATE SCHEMA mine",
        "SELECT * FROM private.secret",
        "SELECT * FROM public.other",
    ):
        _refused(roles.reader_dsn, statement)
    _refused(roles.writer_dsn, "SELECT * FROM private.secret")
    with psycopg.connect(roles.admin) as conn:  # nothing was changed by the refused statements
        assert conn.execute("SELECT count(*) FROM crest_stores").fetchone() == (2,)
        assert conn.execute(sql.SQL("SELECT count(*) > 0 FROM {}").format(sql.Identifier(part))).fetchone() == (True,)
    assert again != old


def test_roles_sql_file_with_psql(roles: Roles, corpus: Path, word_tokenizer_dir: Path) -> None:
    _need_psql()
    _ingest(roles.admin, corpus, "s", word_tokenizer_dir)
    command = ["psql", roles.admin, "-q", "-v", f"reader={roles.reader}", "-v", f"writer={roles.writer}"]
    for _ in range(2):  # idempotent
        done = subprocess.run([*command, "-f", str(SQL / "roles.sql")], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    with psycopg.connect(roles.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(roles.reader), roles.password))
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(roles.writer)))
        conn.execute("CREATE TABLE crest_later (x int)")  # a table the writer adds later
        conn.execute("RESET ROLE")
    with psycopg.connect(roles.reader_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM crest_later").fetchone() == (0,)
        assert conn.execute("SELECT count(*) > 0 FROM crest_ngrams").fetchone() == (True,)
    _refused(roles.reader_dsn, "DELETE FROM crest_ngrams")
    _refused(roles.reader_dsn, "INSERT INTO crest_later VALUES (1)")


@pytest.mark.parametrize(
    ("reader", "writer", "message"),
    [
        ("bad;name", "crest_w", "not a plain identifier"),
        ("same", "same", "must differ"),
        ("PUBLIC", "crest_w", "reserved by PostgreSQL"),
        ("pg_monitor", "crest_w", "reserved by PostgreSQL"),
        ("crest_r", "admin2", "'admin2' exists and holds SUPERUSER, CREATEDB, CREATEROLE"),
        ("crest_r", "maker", "'maker' exists and holds CREATEDB"),
        ("{me}", "crest_w", "is the role connected now"),
    ],
    ids=["unquoted-name", "same-role", "public", "pg-role", "superuser", "createdb", "connected-role"],
)
def test_bad_role_names_are_refused(db_dsn: str, reader: str, writer: str, message: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        me = conn.execute("SELECT current_user").fetchone()
        for role, rights in (("admin2", "SUPERUSER CREATEDB CREATEROLE LOGIN"), ("maker", "CREATEDB LOGIN")):
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("CREATE ROLE {} " + rights).format(sql.Identifier(role)))
    assert me is not None
    try:
        with pytest.raises(ConfigError, match=message):
            create_roles(db_dsn, reader=me[0] if reader == "{me}" else reader, writer=writer)
        with psycopg.connect(db_dsn) as conn:  # nothing taken away, nothing made
            held = conn.execute(
                "SELECT rolname, rolsuper, rolcreatedb FROM pg_roles WHERE rolname IN ('admin2', 'maker', 'crest_r')"
                " ORDER BY rolname"
            ).fetchall()
        assert held == [("admin2", True, True), ("maker", False, True)]
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            for role in ("admin2", "maker"):
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _column_rights(dsn: str, role: str) -> dict[str, set[str]]:
    """Return the crest_learned columns `role` may INSERT and UPDATE."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT attname, has_column_privilege(%s, attrelid, attname, 'INSERT'),"
            " has_column_privilege(%s, attrelid, attname, 'UPDATE')"
            " FROM pg_attribute WHERE attrelid = 'crest_learned'::regclass AND attnum > 0 AND NOT attisdropped",
            (role, role),
        ).fetchall()
    return {"INSERT": {n for n, i, _ in rows if i}, "UPDATE": {n for n, _, u in rows if u}}


@pytest.mark.parametrize("how", ["create_roles", "roles.sql"])
def test_the_reader_may_insert_learned_rows_with_figures_and_nothing_more(roles: Roles, how: str) -> None:
    if how == "roles.sql":
        _need_psql()
        command = ["psql", roles.admin, "-q", "-v", f"reader={roles.reader}", "-v", f"writer={roles.writer}"]
        done = subprocess.run([*command, "-f", str(SQL / "roles.sql")], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        with psycopg.connect(roles.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(roles.reader), roles.password))
    else:
        create_roles(roles.admin, reader=roles.reader, writer=roles.writer, reader_password=roles.password)
    assert "accepted_parts" in LEARNED_INSERT_COLUMNS
    assert _column_rights(roles.admin, roles.reader) == {"INSERT": set(LEARNED_INSERT_COLUMNS), "UPDATE": set()}
    with psycopg.connect(roles.reader_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO crest_learned (store, tokens, n_tokens, steps, new_tokens, accepted_parts, dense_version,"
            " dense_first, dense) VALUES ('s', '\\x01000000', 1, 2, 3, '{\"live\": 1}', 7, 0, '\\x003c')"
        )
    _refused(roles.reader_dsn, "UPDATE crest_learned SET accepted_parts = '{}'")
    _refused(
        roles.reader_dsn, "INSERT INTO crest_learned (store, tokens, n_tokens, created_at) VALUES ('s', '', 0, now())"
    )
    with psycopg.connect(roles.admin) as conn:
        assert conn.execute(
            "SELECT steps, new_tokens, accepted_parts, dense_version FROM crest_learned"
        ).fetchall() == [(2, 3, {"live": 1}, 7)]


def _downgrade(dsn: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from crest.db.versions import MIGRATIONS, connect

    engine = create_engine("postgresql+psycopg://", creator=lambda: connect(dsn), poolclass=NullPool)
    config = Config()
    config.set_main_option("script_location", str(resources.files(MIGRATIONS)))
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, revision)
    finally:
        engine.dispose()


def _learned_columns(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'crest_learned'::regclass AND attnum > 0"
            " AND NOT attisdropped ORDER BY attnum"
        ).fetchall()
    return [str(name) for (name,) in rows]


# crest_learned's columns and the reader's INSERT columns at revision 0004 (frozen: later revisions change them)
COLUMNS_0004 = ["id", "store", "tokens", "n_tokens", "prompt_tokens", "source", "created_at", "steps", "new_tokens",
                "draft_tokens", "accepted_tokens", "accepted_static", "accepted_live", "accepted_prompt"]  # fmt: skip
INSERT_0004 = {"store", "tokens", "n_tokens", "prompt_tokens", "source", *COLUMNS_0004[7:]}


def test_migration_0004_adds_the_figures_hands_them_to_appenders_and_goes_back(roles: Roles) -> None:
    _downgrade(roles.admin, "0003")  # from head
    old_columns = ["id", "store", "tokens", "n_tokens", "prompt_tokens", "source", "created_at"]
    assert _learned_columns(roles.admin) == old_columns
    with psycopg.connect(roles.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(roles.reader)))
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(roles.writer)))
        conn.execute(
            sql.SQL("GRANT INSERT (store, tokens, n_tokens, prompt_tokens, source) ON crest_learned TO {}").format(
                sql.Identifier(roles.reader)
            )
        )  # what 0003's `crest db roles` granted
        conn.execute(sql.SQL("GRANT SELECT ON crest_learned TO {}").format(sql.Identifier(roles.writer)))
        conn.execute("INSERT INTO crest_learned (store, tokens, n_tokens) VALUES ('s', '\\x01000000', 1)")
    assert upgrade(roles.admin, revision="0004") == "0004"
    assert _learned_columns(roles.admin) == COLUMNS_0004
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == INSERT_0004
    assert _column_rights(roles.admin, roles.writer)["INSERT"] == set()  # no append right before: none now
    with psycopg.connect(roles.admin) as conn:
        assert conn.execute("SELECT steps, accepted_live FROM crest_learned").fetchall() == [(0, 0)]
    _downgrade(roles.admin, "0003")
    assert _learned_columns(roles.admin) == old_columns
    with psycopg.connect(roles.admin) as conn:
        assert conn.execute("SELECT n_tokens FROM crest_learned").fetchall() == [(1,)]  # the rows stay
    assert upgrade(roles.admin, revision="0004") == "0004"  # and up again


def _parts(dsn: str) -> list[tuple[int, Any]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT steps, accepted_parts FROM crest_learned ORDER BY id").fetchall()


def _old_parts(dsn: str) -> list[tuple[int, int, int, int]]:
    with psycopg.connect(dsn) as conn:
        query = "SELECT steps, accepted_static, accepted_live, accepted_prompt FROM crest_learned ORDER BY id"
        return conn.execute(query).fetchall()


def test_migration_0005_moves_the_parts_into_jsonb_with_their_rows_and_grants_and_goes_back(roles: Roles) -> None:
    _downgrade(roles.admin, "0004")  # from head
    assert _learned_columns(roles.admin) == COLUMNS_0004
    old_rows = [(3, 6, 0, 2), (1, 0, 0, 0), (0, 0, 0, 0), (2, 0, 4, 0)]  # steps, static, live, prompt
    with psycopg.connect(roles.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(roles.reader)))
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(roles.writer)))
        conn.execute(
            sql.SQL("GRANT INSERT ({}) ON crest_learned TO {}").format(
                sql.SQL(", ").join(map(sql.Identifier, sorted(INSERT_0004))), sql.Identifier(roles.reader)
            )
        )  # what 0004's `crest db roles` granted
        conn.execute(sql.SQL("GRANT SELECT ON crest_learned TO {}").format(sql.Identifier(roles.writer)))
        for row in old_rows:
            conn.execute(
                "INSERT INTO crest_learned (store, tokens, n_tokens, steps, accepted_static, accepted_live,"
                " accepted_prompt) VALUES ('s', '\\x01000000', 1, %s, %s, %s, %s)",
                row,
            )
    assert upgrade(roles.admin, revision="0005") == "0005"
    columns_0005 = [c.name for c in learned.columns if c.name not in LEARNED_DENSE]  # 0007 adds those
    assert _learned_columns(roles.admin) == columns_0005  # the schema module mirrors it
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == set(LEARNED_INSERT_COLUMNS) - set(LEARNED_DENSE)
    assert _column_rights(roles.admin, roles.writer)["INSERT"] == set()  # no append right before: none now
    want = [(3, {"static": 6, "prompt": 2}), (1, {}), (0, {}), (2, {"live": 4})]  # only the parts that held some
    assert _parts(roles.admin) == want
    with psycopg.connect(roles.admin, autocommit=True) as conn:  # the reader appends a part no migration knows
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(roles.reader)))
        conn.execute(
            "INSERT INTO crest_learned (store, tokens, n_tokens, steps, accepted_parts)"
            " VALUES ('s', '\\x01000000', 1, 5, '{\"dense\": 3, \"live\": 1}')"
        )
    _downgrade(roles.admin, "0004")
    assert _learned_columns(roles.admin) == COLUMNS_0004
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == INSERT_0004
    assert _column_rights(roles.admin, roles.writer)["INSERT"] == set()
    assert _old_parts(roles.admin) == [*old_rows, (5, 0, 1, 0)]  # the three columns back; dense has none: lost
    assert upgrade(roles.admin, revision="0005") == "0005"  # and up again
    assert _parts(roles.admin) == [*want, (5, {"live": 1})]


def test_migration_0007_adds_the_dense_columns_hands_them_to_appenders_and_goes_back(roles: Roles) -> None:
    create_roles(roles.admin, reader=roles.reader, writer=roles.writer, reader_password=roles.password)
    _downgrade(roles.admin, "0006")
    assert not set(LEARNED_DENSE) & set(_learned_columns(roles.admin))
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == set(LEARNED_INSERT_COLUMNS) - set(LEARNED_DENSE)
    with psycopg.connect(roles.reader_dsn, autocommit=True) as conn:  # a row learned before
        conn.execute("INSERT INTO crest_learned (store, tokens, n_tokens) VALUES ('s', '\\x01000000', 1)")
    upgrade(roles.admin)
    assert _learned_columns(roles.admin) == [c.name for c in learned.columns]  # the schema module mirrors it
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == set(LEARNED_INSERT_COLUMNS)
    with psycopg.connect(roles.reader_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO crest_learned (store, tokens, n_tokens, dense_version, dense_first, dense)"
            " VALUES ('s', '\\x0100000002000000', 2, 5, 0, '\\x003c')"
        )
    with psycopg.connect(roles.admin) as conn:
        rows = conn.execute("SELECT dense_version, dense_first, dense FROM crest_learned ORDER BY id").fetchall()
    assert rows == [(None, None, None), (5, 0, b"\x00\x3c")]  # the old row without vectors
    _downgrade(roles.admin, "0006")
    assert not set(LEARNED_DENSE) & set(_learned_columns(roles.admin))
    assert _column_rights(roles.admin, roles.reader)["INSERT"] == set(LEARNED_INSERT_COLUMNS) - set(LEARNED_DENSE)
