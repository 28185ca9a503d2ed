"""Configuration precedence (option > CREST_* environment > default) and value parsing."""

from __future__ import annotations

import pytest

from crest.config import IngestOptions, check_store_name, parse_size, resolve_dsn
from crest.errors import ConfigError, InvalidName


def test_dsn_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREST_DATABASE_URL", "postgresql://env/db")
    assert resolve_dsn("postgresql://option/db") == "postgresql://option/db"
    assert resolve_dsn(None) == "postgresql://env/db"
    assert resolve_dsn(" ") == "postgresql://env/db"  # blank is not given: it would mean libpq's local defaults


def test_dsn_falls_back_to_the_embedded_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREST_DATABASE_URL", "  ")
    assert "host=" in resolve_dsn(None) and resolve_dsn(" ") == resolve_dsn(None)  # a unix socket under CREST_HOME


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("200MB", 200_000_000), ("1.5G", 1_500_000_000), ("64MiB", 64 * 2**20), ("2kb", 2000)],
    ids=["bytes", "MB", "G", "MiB", "kb"],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-5", "0", "abc", "5 parsecs"], ids=["empty", "negative", "zero", "word", "unit"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("name", ["", "1abc", "a-b", "x;drop table y", "a" * 64, "é"], ids=str)
def test_store_names_must_be_identifiers(name: str) -> None:
    with pytest.raises(InvalidName):
        check_store_name(name)


@pytest.mark.parametrize(
    "options",
    [
        IngestOptions(top_t=0),
        IngestOptions(top_t=5, budget=100),
        IngestOptions(max_n=0, top_t=1),
        IngestOptions(tree_size=0, top_t=1),
        IngestOptions(continuation_length=-1, top_t=1),
        IngestOptions(selection="single", top_t=1),
    ],
    ids=["top-t-0", "both", "max-n-0", "tree-size-0", "negative-length", "single-without-n"],
)
def test_invalid_ingest_options(options: IngestOptions) -> None:
    with pytest.raises(ConfigError):
        options.validate()


def test_the_store_name_and_dsn_rules_are_the_sdks() -> None:
    import crest_client.names

    assert check_store_name is crest_client.names.check_store_name
    assert resolve_dsn is crest_client.names.resolve_dsn
