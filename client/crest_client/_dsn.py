"""DSN checks shared by the name and host rules: the servers a DSN names, and DSNs libpq can only fail on.

A DSN may name several servers as libpq does (`host=a,b port=5432,5433`, or `postgresql://a:5432,b:5433/db`);
`check_dsn` refuses, before any connection, one that would only ever fail (a typo is an error, not a database
that seems down). `crest_client.names` and `crest_client.hosts` both call these.
"""

from __future__ import annotations

from crest_client.errors import InvalidDsn

SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
LOAD_BALANCE = ("disable", "random")
CHOICES = {  # libpq's options with a fixed set of values (PostgreSQL 18), which it refuses only when connecting
    "target_session_attrs": SESSION_ATTRS,
    "load_balance_hosts": LOAD_BALANCE,
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
}


def hosts(dsn: str) -> list[str]:
    """Return 'host:port' for each server the DSN names, in the order a connection tries them."""
    params = dsn_params(dsn)
    names = (params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = (params.get("port") or "5432").split(",")
    if len(ports) not in (1, len(names)):
        raise InvalidDsn(f"the DSN names {len(names)} hosts but {len(ports)} ports: give one port, or one per host")
    ports = ports * len(names) if len(ports) == 1 else ports
    for port in ports:
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise InvalidDsn(f"the DSN's port {port!r} is not a port number")
    return [f"{name or 'localhost'}:{port or '5432'}" for name, port in zip(names, ports, strict=True)]


def check_dsn(dsn: str) -> str:
    """Return `dsn` when libpq can use it (hosts and ports match, known option values), else raise InvalidDsn."""
    params = dsn_params(dsn)
    hosts(dsn)
    named, addresses = params.get("host"), params.get("hostaddr")
    if named and addresses and len(named.split(",")) != len(addresses.split(",")):
        raise InvalidDsn("the DSN's host and hostaddr lists differ in length")
    for key, allowed in CHOICES.items():
        value = params.get(key)
        if value is not None and value not in allowed:
            raise InvalidDsn(f"the DSN's {key}={value!r} is not one of {', '.join(allowed)}")
    return dsn


def dsn_params(dsn: str) -> dict[str, str]:
    import psycopg

    try:
        return {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(dsn).items() if v is not None}
    except psycopg.Error as exc:
        raise InvalidDsn(f"the DSN cannot be parsed: {' '.join(str(exc).split())}") from None
