"""The readers' DSN rule and multi-host DSNs: which DSN a reader uses, the servers a DSN names, and the DSNs that
are refused before any connection (a typo is an error at once, never a database that seems to be down)."""

from __future__ import annotations

import time

import pytest
from crest_client import InvalidDsn, Store
from crest_client.hosts import check_dsn, hosts, resolve_read_dsn

from crest.drafters.store import open_store


@pytest.mark.parametrize(
    ("read", "dsn", "env_read", "env_write", "expected"),
    [
        ("host=r-opt", "host=w-opt", "host=r-env", "host=w-env", "host=r-opt"),
        (None, "host=w-opt", "host=r-env", "host=w-env", "host=w-opt"),
        (None, None, "host=r-env", "host=w-env", "host=r-env"),
        (None, None, None, "host=w-env", "host=w-env"),
    ],
    ids=["read-option", "dsn-option", "read-env", "write-env"],
)
def test_read_dsn_precedence(
    monkeypatch: pytest.MonkeyPatch,
    read: str | None,
    dsn: str | None,
    env_read: str | None,
    env_write: str | None,
    expected: str,
) -> None:
    for name, value in (("CREST_READ_DATABASE_URL", env_read), ("CREST_DATABASE_URL", env_write)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert resolve_read_dsn(read, dsn=dsn) == expected


def test_read_dsn_falls_back_to_the_embedded_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CREST_READ_DATABASE_URL", raising=False)
    monkeypatch.delenv("CREST_DATABASE_URL", raising=False)
    assert "host=" in resolve_read_dsn()  # a unix socket under CREST_HOME


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("host=a,b port=5433,5434 dbname=x", ["a:5433", "b:5434"]),
        ("host=a,b port=6000 dbname=x", ["a:6000", "b:6000"]),
        ("postgresql://u@a:5433,b/x?target_session_attrs=read-only", ["a:5433", "b:5432"]),
        ("postgresql://u@a,b:7/x?load_balance_hosts=random", ["a:5432", "b:7"]),
        ("postgresql://u@a/x?sslmode=verify-full&channel_binding=require&gssencmode=disable", ["a:5432"]),
        ("hostaddr=10.0.0.1,10.0.0.2 dbname=x", ["10.0.0.1:5432", "10.0.0.2:5432"]),
    ],
    ids=["keywords", "one-port", "uri-default-port", "uri-empty-port", "ssl-options", "hostaddr"],
)
def test_hosts_in_the_order_connections_try_them(dsn: str, expected: list[str]) -> None:
    assert hosts(check_dsn(dsn)) == expected


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        ("host=a,b port=1,2,3 dbname=x", "names 2 hosts but 3 ports"),
        ("host=a,b hostaddr=10.0.0.1 dbname=x", "host and hostaddr lists differ"),
        ("host=a,b target_session_attrs=replica dbname=x", "target_session_attrs='replica' is not one of"),
        ("host=a,b load_balance_hosts=sometimes dbname=x", "load_balance_hosts='sometimes' is not one of"),
        ("host=a nonsense=1", "cannot be parsed"),
        ("postgresql://[::1/x", "cannot be parsed"),
        ("postgresql://a:1:2/x", "port '1:2' is not a port number"),
        ("postgresql://a/x?sslmode=bogus", "sslmode='bogus' is not one of disable, allow"),
        ("host=a sslmode=Require dbname=x", "sslmode='Require' is not one of"),  # libpq compares exactly
        ("host=a gssencmode=always dbname=x", "gssencmode='always' is not one of"),
        ("host=a channel_binding=yes dbname=x", "channel_binding='yes' is not one of"),
    ],
    ids=[
        "ports",
        "hostaddr",
        "session-attrs",
        "load-balance",
        "unknown-key",
        "bad-uri",
        "bad-port",
        "sslmode",
        "sslmode-case",
        "gssencmode",
        "channel-binding",
    ],  # fmt: skip
)
def test_unusable_dsns_are_refused(dsn: str, says: str) -> None:
    with pytest.raises(InvalidDsn, match=says) as refused:
        check_dsn(dsn)
    assert "\n" not in str(refused.value)


def test_store_and_drafter_refuse_an_unusable_dsn_at_once() -> None:
    bad = "host=127.0.0.1,127.0.0.1 port=1,2,3 dbname=x connect_timeout=10"
    started = time.monotonic()
    with pytest.raises(InvalidDsn):
        Store.connect(bad, "demo")
    with pytest.raises(InvalidDsn):  # not a PendingStore that would retry a typo for ever
        open_store("demo", dsn=bad)
    assert time.monotonic() - started < 1.0
