"""The front door: usage errors, --version, CREST_* variables, fresh and unreachable databases, stores at 80
columns, `crest db url/query/queries`, Ctrl-C, and `server stop` without XDG_RUNTIME_DIR.

Commands run through `crest.cli.main()` (the same error mapping as the `crest` script) in this process, or as
a real subprocess where a signal, the terminal width or a warning at import matters.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from crest.cli.app import app
from crest.config import IngestOptions
from crest.errors import EXIT_DATABASE, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE
from crest.ingest.pipeline import ingest
from tests.fix_cli import Terminal, one_error_line, run
from tests.fix_store import OLD_TEXT, ROWS, publish, snapshot, visible_state, write_corpus

pytest_plugins = ["tests.fix_corpus"]

REFUSED = "postgresql://crest@127.0.0.1:1/nothing?connect_timeout=5"  # nothing listens on port 1


USAGE = [
    ("unknown-option", ["lookup", "--max_nodes", "3", "x"], r"No such option: --max_nodes"),
    ("missing-argument", ["lookup", "--store", "s"], r"Missing argument"),
    ("unknown-command", ["nope"], r"No such command 'nope'"),
    ("unknown-subcommand", ["db", "nope"], r"No such command 'nope'"),
    ("bad-int", ["lookup", "--max-nodes", "many", "--store", "s", "x"], r"Invalid value for '--max-nodes'"),
]


@pytest.mark.parametrize(("args", "pattern"), [u[1:] for u in USAGE], ids=[u[0] for u in USAGE])
def test_usage_errors_show_usage_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], pattern: str
) -> None:
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("Usage: crest") and "--help' for help" in err and re.search(pattern, err), err
    assert "unexpected" not in err and "Traceback" not in err


def test_version(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert run(monkeypatch, capsys, "--version") == (0, f"crest {version('crest')}\n", "")


def test_shared_options_read_their_environment_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, dict[str, Any]] = {}
    monkeypatch.setattr("crest.cli.generate.run_generate", lambda **kw: seen.setdefault("generate", kw))
    monkeypatch.setattr("crest.bench.generate.bench_generate", lambda **kw: seen.setdefault("bench", kw) and [])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    env = {"CREST_MODEL": "m1", "CREST_DEVICE": "cuda", "CREST_DTYPE": "bfloat16", "CREST_MAX_NEW_TOKENS": "7"}
    env |= {"CREST_CHAT": "1", "CREST_MAX_DRAFT_TOKENS": "3", "CREST_STORE": "code", "CREST_JSON": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert run(monkeypatch, capsys, "generate", "hi", "--dtype", "float16")[0] == 0  # the option beats the variable
    bench = ["bench", "generate", "--prompts", str(prompts), "--drafters", "none,crest"]
    code, out, err = run(monkeypatch, capsys, *bench)
    assert code == 0, err
    assert json.loads(out)["model"] == "m1"  # CREST_JSON: one JSON object
    for name in ("generate", "bench"):
        got = seen[name]
        assert (got["model"], got["device"], got["max_new_tokens"], got["chat"]) == ("m1", "cuda", 7, True), name
        assert (got["max_draft_tokens"], got["store"]) == (3, "code"), name
    assert seen["generate"]["dtype"] == "float16" and seen["bench"]["dtype"] == "bfloat16"


def test_bench_ingest_does_not_take_crest_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREST_STORE", "precious")  # bench ingest replaces and drops its store: never this one
    help_text = CliRunner().invoke(app, ["bench", "ingest", "--help"], env={"COLUMNS": "200"}).output
    assert "bench_ingest" in help_text and "CREST_STORE" not in help_text


def test_help_keeps_square_brackets_and_shows_no_value_for_flags() -> None:
    def help_of(*command: str) -> str:
        done = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
        assert done.exit_code == 0, done.output
        return done.output

    assert '{"tokens": [ids]}' in help_of("learn") and "pip install 'crest[spark]'" in help_of("ingest")
    lookup = help_of("lookup")
    assert re.search(r"--json\s+Print JSON", lookup) and re.search(r"--help\s+Show this", lookup), lookup
    assert "<bool>" not in lookup + help_of("bench", "ingest") + help_of("serve"), lookup
    assert "lookup [OPTIONS] {TEXT}" in lookup  # the argument by its name, not its type


@pytest.mark.parametrize("drafter", ["magic", "crest"], ids=["unknown", "crest-without-store"])
def test_bad_drafter_is_refused_before_the_model_loads(tmp_path: Path, drafter: str) -> None:
    env = {**os.environ, "CREST_DATABASE_URL": REFUSED}
    env.pop("CREST_STORE", None)
    args = [sys.executable, "-m", "crest.cli", "generate", "x", "--drafter", drafter, "--model", str(tmp_path / "no")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    line = one_error_line(done.stderr)
    assert done.returncode == EXIT_USAGE and ("unknown drafter 'magic'" in line or "needs --store" in line), line


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_store_is_said_before_the_model_loads(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    args = [command, *(["x"] if command == "generate" else []), "--store", "nosuch", "--drafter", "crest"]
    code, out, err = run(monkeypatch, capsys, *args, "--model", str(tmp_path / "no-model"), "--dsn", db_dsn)
    assert code == EXIT_FAILURE and "no published store named 'nosuch'" in one_error_line(err), err


def test_generate_reads_the_schema_and_never_migrates_it(
    empty_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from crest.db.connection import head_revision, schema_revision, upgrade

    args = ["generate", "x", "--store", "s", "--drafter", "crest", "--model", str(tmp_path / "no-model")]
    code, _, err = run(monkeypatch, capsys, *args, "--dsn", empty_db)
    assert code == EXIT_FAILURE and "no published store named 's'" in one_error_line(err), err
    assert schema_revision(empty_db) is None  # a read command: no crest schema was created
    upgrade(empty_db, revision="0006")  # a schema one migration behind this crest's
    code, _, err = run(monkeypatch, capsys, *args, "--dsn", empty_db)
    line = one_error_line(err)
    assert code == EXIT_DATABASE and "revision 0006" in line and "crest db upgrade" in line, err
    assert schema_revision(empty_db) == "0006" != head_revision()  # still behind: said, not migrated


FORWARD = """
import torch, transformers
{imports}
from tests.fix_models import tiny_model
model = tiny_model("llama", vocab=100, max_positions=64, dtype=torch.float32)
model(torch.tensor([[1, 2, 3]]), past_key_values=transformers.DynamicCache(), use_cache=True)
"""


@pytest.mark.slow  # two subprocesses, each importing torch and transformers
def test_model_calls_print_no_cache_deprecation_warning() -> None:
    """transformers 5 warns on each forward given `past_key_values`: crest's model calls (generate, serve) do not."""

    def stderr_of(imports: str) -> str:
        args = [sys.executable, "-W", "always::FutureWarning", "-c", FORWARD.format(imports=imports)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        return done.stderr

    plain = stderr_of("")
    if "past_key_values" not in plain:
        pytest.skip(f"transformers {version('transformers')} does not warn about past_key_values")
    assert "past_key_values" not in stderr_of("import crest.decoding")


READERS = [
    ("lookup", ["lookup", "--store", "s", "x"], EXIT_FAILURE, r"no published store named 's'"),
    ("drop", ["drop", "s"], EXIT_FAILURE, r"no published store named 's'"),
    ("bench-lookup", ["bench", "lookup", "--store", "s"], EXIT_FAILURE, r"no published store named 's'"),
    ("bench-ceiling", ["bench", "ceiling", "-s", "s", "--prompts", "humaneval"], EXIT_FAILURE, r"no published store"),
    ("stores", ["stores"], EXIT_FAILURE, r"no store: the database has no crest schema"),
    ("query", ["db", "query", "coverage"], EXIT_FAILURE, r"no store: the database has no crest schema"),
]


@pytest.mark.parametrize(("args", "code", "pattern"), [r[1:] for r in READERS], ids=[r[0] for r in READERS])
def test_commands_that_read_a_fresh_database(
    empty_db: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    code: int,
    pattern: str,
) -> None:
    got, out, err = run(monkeypatch, capsys, *args, "--dsn", empty_db)
    assert got == code, err
    assert re.search(pattern, one_error_line(err) if code else out), (out, err)
    assert "crest_stores" not in err


def test_lookup_says_which_suffix_matched_and_takes_the_rule(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # "on" is followed by "mat" 300 times; the 4-gram "the cat sat on" once, by "a": on an unpruned build the
    # expected rule drafts from the common 1-token suffix, the longest rule from the rare 4-token one. The default
    # build (prune) keeps only the rows expected drafts from: both rules fetch the 1-token row, the store decided
    corpus = write_corpus(tmp_path / "c.jsonl", ["dog on mat"] * 150 + ["the cat sat on a"])
    for store, rule_name in (("words", "lookup"), ("pruned", "prune")):
        options = IngestOptions(suffix_rule=rule_name)
        ingest([str(corpus)], store=store, tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    text = "the cat sat on"
    cases = [
        ("words", "expected", "expected", 1, ["on"], "mat"),
        ("words", "longest", "longest", 4, text.split(), "a"),
        ("pruned", "expected", "prune", 1, ["on"], "mat"),
        ("pruned", "longest", "prune", 1, ["on"], "mat"),
    ]
    for store, rule, shown, n, suffix, first in cases:
        code, out, err = run(monkeypatch, capsys, "lookup", "--store", store, text, "--rule", rule, "--json")
        found = json.loads(out)
        assert code == 0 and (found["rule"], found["n"], found["suffix"]["text"]) == (shown, n, suffix), (out, err)
        assert found["text"][0] == first
        code, out, _ = run(monkeypatch, capsys, "lookup", "--store", store, text, "--rule", rule)
        quoted = " ".join(repr(word) for word in suffix)
        assert code == 0 and f"matched suffix {quoted} ({n} token(s), rule {shown})" in " ".join(out.split()), out
    monkeypatch.setenv("CREST_SUFFIX_RULE", "longest")
    assert json.loads(run(monkeypatch, capsys, "lookup", "--store", "words", text, "--json")[1])["n"] == 4
    code, out, err = run(monkeypatch, capsys, "lookup", "--store", "words", text, "--rule", "shortest")
    assert code == EXIT_USAGE and "unknown suffix rule 'shortest'" in one_error_line(err)


def test_drop_asks_first_and_refuses_without_a_terminal(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sid = publish(db_dsn, "demo", ROWS)
    publish(db_dsn, "other", ROWS)
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # a pipe: no one to ask
    code, out, err = run(monkeypatch, capsys, "drop", "demo")
    assert code == EXIT_USAGE and out == "" and "add --yes" in one_error_line(err)
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, out, err = run(monkeypatch, capsys, "drop", "demo")
    assert code == EXIT_FAILURE and f"Drop store 'demo' (static version {sid}) and its 0 learned rows?" in out
    assert "aborted" in err
    names = {r["name"] for r in json.loads(run(monkeypatch, capsys, "stores", "--json")[1])}
    assert names == {"demo", "other"}
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    asked = f"Drop store 'demo' (static version {sid}) and its 0 learned rows? [y/N]: "
    assert run(monkeypatch, capsys, "drop", "demo")[:2] == (0, f"{asked}dropped store 'demo' (version {sid})\n")
    assert run(monkeypatch, capsys, "drop", "other", "--yes")[0] == 0
    assert run(monkeypatch, capsys, "stores")[1] == "no store yet: run crest ingest\n"


UNREACHABLE = [
    ("lookup", ["lookup", "--store", "s", "x"]),
    ("stores", ["stores"]),
    ("drop", ["drop", "s"]),
    ("ingest", ["ingest", "{corpus}", "--store", "s", "--tokenizer", "{tokenizer}", "-q"]),
    ("db-upgrade", ["db", "upgrade"]),
    ("db-query", ["db", "query", "coverage"]),
    ("bench-lookup", ["bench", "lookup", "--store", "s"]),
]


@pytest.mark.parametrize("args", [u[1] for u in UNREACHABLE], ids=[u[0] for u in UNREACHABLE])
def test_an_unreachable_database_is_one_line_exit_3_at_once(
    tmp_path: Path,
    word_tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("the cat sat on the mat\n")
    args = [str(corpus) if a == "{corpus}" else str(word_tokenizer_dir) if a == "{tokenizer}" else a for a in args]
    monkeypatch.setenv("CREST_DATABASE_URL", REFUSED)
    started = time.monotonic()
    code, _, err = run(monkeypatch, capsys, *args)
    assert time.monotonic() - started < 5
    line = one_error_line(err)
    assert code == EXIT_DATABASE and "Connection refused" in line and "port 1" in line, err


IMPOSSIBLE_DSNS = [
    ("hosts-and-ports", "host=a,b port=1,2,3", "2 hosts but 3 ports"),
    ("port", "postgresql://x:notaport/db", "not a port number"),
    ("unparsable", "nonsense dsn", "cannot be parsed"),
    ("session-attrs", "host=a target_session_attrs=bogus", "target_session_attrs='bogus'"),
]


@pytest.mark.parametrize(("dsn", "says"), [d[1:] for d in IMPOSSIBLE_DSNS], ids=[d[0] for d in IMPOSSIBLE_DSNS])
@pytest.mark.parametrize("via", ["option", "env"])
def test_a_dsn_that_can_only_fail_is_bad_input_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dsn: str, says: str, via: str
) -> None:
    if via == "env":
        monkeypatch.setenv("CREST_DATABASE_URL", dsn)
    code, out, err = run(monkeypatch, capsys, "stores", *(["--dsn", dsn] if via == "option" else []))
    assert code == EXIT_USAGE and out == "" and says in one_error_line(err), err


def test_stores_fit_80_columns(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> None:
    options = IngestOptions(top_t=1000, max_n=3, continuation_length=4)
    corpus = write_corpus(tmp_path / "c.jsonl", OLD_TEXT)
    for name in ("stdlib", "a_store_with_a_long_descriptive_name"):
        ingest([str(corpus)], store=name, tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # README-sized figures, the widest cells
        figures = {"kept": {"1": 224_000, "2": 1_000_000}, "tokens": 12_345_678}
        conn.execute("UPDATE crest_stores SET figures = %s", (json.dumps(figures),))
        chose = json.dumps({**figures, "suffix_choice": {"rule": "longest"}})  # what an `auto` build records
        conn.execute(
            "UPDATE crest_stores SET figures = %s, params = jsonb_set(params, '{suffix_rule}', '\"auto\"')"
            " WHERE name = 'a_store_with_a_long_descriptive_name'",
            (chose,),
        )
    # a terminal 80 columns wide (rich's TTY_COMPATIBLE; piped output has one shape at any width: test_cli_plain)
    env = {**os.environ, "COLUMNS": "80", "CREST_DATABASE_URL": db_dsn, "TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    for extra in ([], ["--all"]):
        done = subprocess.run(
            [sys.executable, "-m", "crest.cli", "stores", *extra], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        shown = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # the title's bold
        assert "…" not in shown and max(len(line) for line in shown.splitlines()) <= 80, shown
        for value in ("stdlib", "a_store_with_a_long_descriptive_name", "1,224,000", "12,345,678", "auto:longest"):
            assert value in shown, shown
        assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d", shown)) == 2, shown
        assert ("state" in shown) == bool(extra)  # a column or a line of each block, with --all only
        assert re.search(r"\bprune\b", shown), "the default build's rule"


def test_db_url(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CREST_DATABASE_URL", "postgresql://from-env/x")
    assert run(monkeypatch, capsys, "db", "url")[:2] == (0, "postgresql://from-env/x\n")
    assert run(monkeypatch, capsys, "db", "url", "--dsn", "postgresql://opt/y")[:2] == (0, "postgresql://opt/y\n")


def test_db_queries_run_every_shipped_query(
    db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from crest.db.queries import list_queries

    publish(db_dsn, "demo", ROWS)
    code, listed, _ = run(monkeypatch, capsys, "db", "queries")
    names = [line.split()[0] for line in listed.splitlines() if "psql only" not in line]
    shipped = ["coverage", "dense", "disk_use", "learned", "live_acceptance", "part_acceptance", "top_ngrams"]
    shipped += ["tree_sizes"]
    assert code == 0 and names == shipped, listed
    assert run(monkeypatch, capsys, "db", "query", "--list")[1] == listed
    for query in list_queries():
        code, out, err = run(monkeypatch, capsys, "db", "query", query.name, "--json", "--dsn", db_dsn)
        if query.psql_only:
            assert code == EXIT_USAGE and "psql" in one_error_line(err)
            continue
        rows = [json.loads(line) for line in out.splitlines()]
        if query.name in ("dense", "live_acceptance", "part_acceptance"):  # none: no dense part, no served figures
            assert (code, rows) == (0, []), (out, err)
            continue
        assert code == 0 and rows and all(row["store"] == "demo" for row in rows), (query.name, out, err)
        numbers_as_text = [v for row in rows for v in row.values() if isinstance(v, str) and re.fullmatch(r"[\d.]+", v)]
        assert numbers_as_text == [], (query.name, out)  # SQL numerics print as JSON numbers
    own = tmp_path / "mine.sql"
    own.write_text("-- Store names.\nSELECT name FROM crest_stores\n")
    code, out, _ = run(monkeypatch, capsys, "db", "query", str(own), "--dsn", db_dsn)
    assert code == 0 and "Store names" in out and "demo" in out
    code, _, err = run(monkeypatch, capsys, "db", "query", "nope", "--dsn", db_dsn)
    assert code == EXIT_USAGE and "no query 'nope'" in one_error_line(err)
    for text, why in [
        ("-- Escapes.\nSELECT 1 AS one; COMMIT; CREATE TABLE escaped (a int)\n", "more than one statement"),
        ("-- Two.\nSELECT 1; SELECT 2\n", "more than one statement"),
        ("-- Nothing.\n", "holds no statement"),
    ]:
        own.write_text(text)
        code, out, err = run(monkeypatch, capsys, "db", "query", str(own), "--dsn", db_dsn)
        assert (code, out) == (EXIT_USAGE, "") and why in one_error_line(err), (text, err)
    with psycopg.connect(db_dsn) as conn:  # read-only held: the statement after COMMIT never ran
        assert conn.execute("SELECT to_regclass('escaped')").fetchone() == (None,)


def test_a_reader_that_goes_away_is_exit_0(db_dsn: str, tmp_path: Path) -> None:
    """`crest ... | head -1`: the pipe closes while crest still writes; that is no error."""
    many = tmp_path / "many.sql"
    many.write_text("-- Many rows.\nSELECT i FROM generate_series(1, 200000) AS i\n")  # far more than a pipe holds
    args = [sys.executable, "-m", "crest.cli", "db", "query", str(many), "--json", "--dsn", db_dsn]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:  # closes both
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline()) == {"i": 1}
        proc.stdout.close()
        assert (proc.wait(120), proc.stderr.read()) == (0, "")


def test_server_stop_says_nothing_on_stderr_without_xdg_runtime_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"} | {"CREST_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "crest.cli", "server", "stop"], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "not running\n", "")


@pytest.mark.slow  # a `crest ingest` subprocess per case, about 10 s each
@pytest.mark.parametrize(
    ("stage", "sig", "said", "code"),
    [
        ("count", signal.SIGINT, "interrupted", EXIT_INTERRUPTED),
        ("load", signal.SIGINT, "interrupted", EXIT_INTERRUPTED),
        ("load", signal.SIGTERM, "terminated", EXIT_TERMINATED),  # docker stop, systemd: cleaned up as Ctrl-C
    ],
    ids=["ctrl-c-before-build", "ctrl-c-during-load", "sigterm-during-load"],
)
def test_a_stopped_ingest_says_why_exits_its_code_and_keeps_the_previous_version(
    db_dsn: str,
    word_tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    sig: signal.Signals,
    said: str,
    code: int,
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CREST_HOME", str(home))
    options = IngestOptions(top_t=1000, max_n=3, continuation_length=4)
    old = ingest([str(write_corpus(tmp_path / "old.jsonl", OLD_TEXT))], store="words",
                 tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)  # fmt: skip
    before, old_snapshot = visible_state(db_dsn), snapshot(db_dsn, "words")
    new_corpus = write_corpus(tmp_path / "new.jsonl", [t[::-1] for t in OLD_TEXT])
    env = {**os.environ, "CREST_DATABASE_URL": db_dsn, "CREST_FAULT_PAUSE": stage}
    args = [sys.executable, "-m", "crest.cli", "ingest", str(new_corpus), "--store", "words", "--top-t", "1000"]
    args += ["--tokenizer", str(word_tokenizer_dir), "--max-n", "3", "--continuation-length", "4", "-q"]
    # a shell starts background jobs with SIGINT ignored, and a child inherits that: give the ingest a terminal's
    # Ctrl-C whatever ran this suite (an ignored SIGINT made this test time out under `.ci/run &`)
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watchdog = threading.Timer(300, proc.kill)  # a stage never reached ends the test instead of hanging it
    watchdog.start()
    try:
        assert proc.stderr is not None
        line = ""
        while not line.startswith("crest-fault-pause"):
            line = proc.stderr.readline()
            assert line, "the ingest ended before the stage"
        assert line == f"crest-fault-pause {stage}\n"
        proc.send_signal(sig)  # SIGINT: what Ctrl-C sends
        assert proc.wait(120) == code
        assert one_error_line(proc.stderr.read()) == f"Error: {said}"
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()  # a pipe left open is a ResourceWarning, an error in this suite
    assert visible_state(db_dsn) == before and before["published"] == [old.store_id]
    assert snapshot(db_dsn, "words") == old_snapshot
    with psycopg.connect(db_dsn) as conn:  # the interrupted attempt is marked, not left building
        states = [s for (s,) in conn.execute("SELECT state FROM crest_stores WHERE id <> %s", (old.store_id,))]
    assert states == ([] if stage == "count" else ["failed"])


def test_a_weighted_input_counts_as_if_listed_k_times(
    db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from tests.fix_corpus import write_jsonl
    from tests.fix_learning import published, version_rows

    human = write_jsonl(tmp_path / "human.jsonl", [{"text": "the cat sat on the mat"}, {"text": "a dog sat"}])
    model = write_jsonl(tmp_path / "model.jsonl", [{"text": "the dog sat on a mat"}])
    monkeypatch.setenv("CREST_DATABASE_URL", db_dsn)
    base = ["--tokenizer", str(word_tokenizer_dir), "--max-n", "3", "--continuation-length", "4", "-q"]
    runs = {
        "weighted": [str(human), str(model), "--weight", f"{model}=3"],
        "listed": [str(human), str(model), str(model), str(model)],
        "once": [str(human), str(model)],
    }
    for store, inputs in runs.items():
        code, _, err = run(monkeypatch, capsys, "ingest", *inputs, "--store", store, *base)
        assert code == 0, err
    rows = {store: version_rows(db_dsn, published(db_dsn, store)["static"]) for store in runs}
    assert rows["weighted"] == rows["listed"] != rows["once"]
    code, _, err = run(monkeypatch, capsys, "ingest", str(human), "--store", "bad", "--weight", "other.jsonl=2", *base)
    assert code == 2 and "'other.jsonl' is not one of the inputs" in one_error_line(err)
    assert published(db_dsn, "bad") == {}  # refused before any build began
