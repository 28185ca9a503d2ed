"""Bad input and database errors for `rest-index build`, `db upgrade`, `db roles`, `server start|stop` and
`bench generate`, through the real CLI entry point: one `Error: ...` line naming the problem (never
"unexpected", never a traceback), the documented exit code, and nothing left behind (no index directory, no
table, no role, no file). `ingest`, `generate`, `lookup` and `stores` are covered in tests/test_cli_errors.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from crest.cli.app import main
from crest.errors import EXIT_DATABASE, EXIT_USAGE

pytest_plugins = ["tests.fix_corpus"]

UNREACHABLE = "postgresql://crest@127.0.0.1:1/nowhere?connect_timeout=2"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `crest ARGS` in this process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out = capsys.readouterr()
    code = done.value.code
    return (code if isinstance(code, int) else 0), out.out, out.err


def assert_one_error_line(err: str, pattern: str) -> None:
    """Stderr is exactly one `Error: ...` line, crest's own message, matching `pattern`."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "unexpected" not in lines[0] and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]


def public_tables(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]


# ---- rest-index build --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        pytest.param("missing-input", r"does not exist", id="missing-input"),
        pytest.param("empty-corpus", r"no documents|no tokens", id="empty-corpus"),
        pytest.param("bad-tokenizer", r"cannot load tokenizer", id="bad-tokenizer"),
        pytest.param("out-is-a-file", r"--out .* exists and is not a directory", id="out-is-a-file"),
        pytest.param("out-empty", r"--out is empty", id="out-empty"),
        pytest.param("out-under-a-file", r"cannot create --out .*: Not a directory", id="out-under-a-file"),
        pytest.param("out-holds-other-files", r"holds other files", id="out-holds-other-files"),
    ],
)
def test_rest_index_build_bad_input(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    word_tokenizer_dir: Path,
    case: str,
    pattern: str,
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" if case != "empty-corpus" else "")
    out = tmp_path / "index"
    tokenizer = str(word_tokenizer_dir)
    if case == "missing-input":
        corpus = tmp_path / "missing.txt"
    elif case == "bad-tokenizer":
        tokenizer = str(tmp_path / "no-such-tokenizer")
    elif case == "out-is-a-file":
        out.write_text("precious")
    elif case == "out-holds-other-files":
        out.mkdir()
        (out / "notes.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)
    given = {"out-empty": "", "out-under-a-file": str(corpus / "index")}.get(case, str(out))
    code, stdout, err = run(capsys, "rest-index", "build", str(corpus), "--out", given, "--tokenizer", tokenizer)
    assert code == EXIT_USAGE and stdout == ""
    assert_one_error_line(err, pattern)
    if case == "out-is-a-file":
        assert out.read_text() == "precious"
    elif case == "out-holds-other-files":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    else:
        assert not out.exists(), "no half-written index directory"
    assert {p.name for p in tmp_path.iterdir()} <= {"corpus.txt", "index"}  # `--out ""` wrote into the working dir


# ---- db upgrade, db roles ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "pattern"),
    [(UNREACHABLE, r"cannot connect to the database"), ("host=/nonexistent-socket-dir", r"cannot connect")],
    ids=["unreachable", "no-such-socket"],
)
def test_db_commands_with_an_unreachable_database(capsys: pytest.CaptureFixture[str], dsn: str, pattern: str) -> None:
    for command in (["db", "upgrade"], ["db", "roles"]):
        code, stdout, err = run(capsys, *command, "--dsn", dsn)
        assert code == EXIT_DATABASE and stdout == "", (command, err)
        assert_one_error_line(err, pattern)


def test_db_upgrade_to_an_unknown_revision_changes_nothing(capsys: pytest.CaptureFixture[str], empty_db: str) -> None:
    code, stdout, err = run(capsys, "db", "upgrade", "no_such_revision", "--dsn", empty_db)
    assert code == EXIT_DATABASE and stdout == ""
    assert_one_error_line(err, r"could not migrate.*no_such_revision")
    assert public_tables(empty_db) == [], "the failed migration left no table"


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--reader", "bad;name"], r"bad;name|identifier|role"),
        (["--reader", "same", "--writer", "same"], r"same|differ"),
        (["--reader-password-env", "CREST_TEST_NO_SUCH_VARIABLE"], r"CREST_TEST_NO_SUCH_VARIABLE"),
    ],
    ids=["bad-role-name", "same-roles", "missing-password-variable"],
)
def test_db_roles_bad_input_creates_no_role(
    capsys: pytest.CaptureFixture[str], db_dsn: str, args: list[str], pattern: str
) -> None:
    code, stdout, err = run(capsys, "db", "roles", "--dsn", db_dsn, *args)
    assert code == EXIT_USAGE and stdout == "", err
    assert_one_error_line(err, pattern)
    names = [a for a in args if not a.startswith("--")] + ["crest_reader", "crest_writer"]
    with psycopg.connect(db_dsn) as conn:
        made = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (names,)).fetchall()
    assert made == [], "no role is created when the options are bad"


# ---- server start / stop -----------------------------------------------------------------------------------------


def test_server_start_with_a_home_that_is_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.write_text("not a directory")
    monkeypatch.setenv("CREST_HOME", str(home))
    code, stdout, err = run(capsys, "server", "start")
    assert code == EXIT_DATABASE and stdout == ""
    assert_one_error_line(err, r"could not start the embedded PostgreSQL in .*home")
    assert home.read_text() == "not a directory"


def test_server_stop_when_none_runs_is_no_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREST_HOME", str(tmp_path / "home"))
    code, stdout, err = run(capsys, "server", "stop")
    assert (code, stdout, err) == (0, "not running\n", "")
    assert not (tmp_path / "home").exists(), "stopping creates nothing"


OK = ["--prompts", "{tmp}/ok.jsonl"]


# ---- bench ceiling -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        pytest.param(["--prompts", "{tmp}/missing.jsonl"], r"cannot read|does not exist", id="missing-prompts"),
        pytest.param(["--prompts", "{tmp}/bad.jsonl"], r"line 1 is not valid JSON", id="bad-prompts"),
        pytest.param(["--prompts", "{tmp}/empty.jsonl"], r"no prompts", id="no-prompts"),
        pytest.param([*OK, "--limit", "0"], r"--limit must be at least 1", id="limit-0"),
        pytest.param([*OK, "--max-nodes", "0"], r"--max-nodes", id="no-nodes"),
        pytest.param([*OK, "--references", "{tmp}/ok.jsonl"], r"is not a folder", id="references-a-file"),
    ],
)
def test_bench_ceiling_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], pattern: str
) -> None:
    (tmp_path / "bad.jsonl").write_text("{oops}\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "ok.jsonl").write_text('{"prompt": "def f(x):"}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, stdout, err = run(capsys, "bench", "ceiling", "-s", "s", *argv, "--dsn", "postgresql://nobody@127.0.0.1:1/x")
    assert code == EXIT_USAGE and stdout == "", err
    assert_one_error_line(err, pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- bench generate ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        pytest.param([], r"--prompts", id="no-prompts"),
        pytest.param(
            ["--prompts", "{tmp}/missing.jsonl", "--drafters", "none,prompt"],
            r"cannot read|does not exist",
            id="missing-prompts",
        ),
        pytest.param(
            ["--prompts", "{tmp}/bad.jsonl", "--drafters", "none,prompt"],
            r"line 1 is not valid JSON",
            id="bad-prompts",
        ),
        pytest.param([*OK, "--drafters", "none,bogus"], r"unknown drafter 'bogus'", id="unknown-drafter"),
        pytest.param([*OK, "--drafters", "crest"], r"--store", id="crest-without-store"),
        pytest.param([*OK, "--drafters", "rest"], r"--rest-index", id="rest-without-index"),
        pytest.param(
            [*OK, "--drafters", "none,prompt", "--max-new-tokens", "0"],
            r"max.new.tokens",
            id="no-new-tokens",
        ),
        pytest.param([*OK, "--drafters", "none,prompt", "--limit", "0"], r"no prompts", id="no-prompts-left"),
        pytest.param(["--from-records", "{tmp}/missing.jsonl"], r"cannot read|does not exist", id="missing-records"),
    ],
)
def test_bench_generate_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], pattern: str
) -> None:
    (tmp_path / "bad.jsonl").write_text("{oops}\n")
    (tmp_path / "ok.jsonl").write_text('{"prompt": "def f(x):"}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "results"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    records = str(tmp_path / "r.jsonl")
    code, stdout, err = run(capsys, "bench", "generate", *argv, "--out", str(out), "--records", records)
    assert code == EXIT_USAGE and stdout == "", err
    assert_one_error_line(err, pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "no results folder, no records file"
