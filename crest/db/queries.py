"""The inspection queries shipped with crest (`sql/`, inside the wheel as `crest.sql`), listed, read and run.

A query is one SQL statement whose first comment line says what it shows. Scripts that need psql itself
(`\\set`, `:'variable'`; `roles.sql`) are listed as psql-only and are not run here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg

from crest.db.versions import session
from crest.errors import ConfigError

QUERIES = "crest.sql"
_PSQL_ONLY = re.compile(r"^\s*\\|:'\w+'|:\"\w+\"", re.MULTILINE)


@dataclass(frozen=True)
class Query:
    """One inspection query: its name (file stem), first comment line, text, and whether only psql runs it."""

    name: str
    summary: str
    text: str

    @property
    def psql_only(self) -> bool:
        """Return True when the script uses psql meta-commands or variables."""
        return bool(_PSQL_ONLY.search(_code(self.text)))


def list_queries() -> list[Query]:
    """Return the shipped queries, by name."""
    files = [f for f in resources.files(QUERIES).iterdir() if f.name.endswith(".sql")]
    return sorted((_query(f.name[:-4], f.read_text(encoding="utf-8")) for f in files), key=lambda q: q.name)


def read_query(name_or_path: str) -> Query:
    """Return the shipped query NAME (with or without .sql) or the query in a file; raise ConfigError if none."""
    path = Path(name_or_path)
    if path.suffix == ".sql" and path.is_file():
        try:
            return _query(path.stem, path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    name = path.name.removesuffix(".sql")
    found = {q.name: q for q in list_queries()}
    if name not in found or path.parent != Path("."):
        names = ", ".join(q.name for q in found.values() if not q.psql_only)
        raise ConfigError(f"no query {name_or_path!r}: give a .sql file or one of {names}")
    return found[name]


def run_query(dsn: str, query: Query) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run a query (one statement) in a read-only, repeatable-read transaction; return its column names and rows."""
    if query.psql_only:
        raise ConfigError(f"{query.name}.sql is a psql script (variables, meta-commands): run it with psql -f")
    with session(dsn) as conn:
        conn.read_only = True
        # one snapshot for planning and running: under READ COMMITTED a version published between the two is
        # seen published while the plan holds none of its partitions (its rows count as none)
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        try:  # prepared: the extended protocol runs one statement (a `COMMIT; ...` would leave read-only behind)
            cur = conn.execute(query.text, prepare=True)
        except psycopg.errors.SyntaxError as exc:
            if "multiple commands" not in str(exc):
                raise
            raise ConfigError(f"{query.name} holds more than one statement: a query is one statement") from None
        if cur.pgresult is not None and cur.pgresult.status == psycopg.pq.ExecStatus.EMPTY_QUERY:
            raise ConfigError(f"{query.name} holds no statement")
        columns = [c.name for c in cur.description or []]
        rows = cur.fetchall() if cur.description else []
        conn.rollback()
    return columns, rows


def _query(name: str, text: str) -> Query:
    """Return a query whose summary is the first sentence of its leading comment."""
    words = []
    for line in text.splitlines():
        if not line.startswith("--") or not line[2:].strip():
            break
        words.append(line[2:].strip())
    summary = " ".join(words)
    return Query(name=name, summary=summary.split(". ")[0].split(": ")[0].rstrip("."), text=text)


def _code(text: str) -> str:
    """Return the text without its `--` comments."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())
