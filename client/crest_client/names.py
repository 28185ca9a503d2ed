"""The rules crest and its SDK share about where a store is: a store's name and the database's DSN.

A store name is a plain SQL identifier (it names the store's tables). The DSN comes from the caller's option,
else the `CREST_DATABASE_URL` environment variable, else the embedded default server under `CREST_HOME`,
started on first use.
"""

from __future__ import annotations

import os
import re

from crest_client._dsn import check_dsn
from crest_client.errors import InvalidName

ENV_DSN = "CREST_DATABASE_URL"
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_store_name(name: str) -> str:
    """Return `name` when it is a plain identifier, else raise InvalidName."""
    if not NAME_RE.match(name or ""):
        raise InvalidName(
            f"store name {name!r} is not a plain identifier (letters, digits and _, not starting with a digit, "
            "at most 63 characters)"
        )
    return name


def resolve_dsn(option: str | None = None) -> str:
    """Return the DSN from the option, else CREST_DATABASE_URL, else the embedded default (started).

    A given DSN that can only fail (see `crest_client.hosts.check_dsn`) raises InvalidDsn before any connection.
    """
    if option and option.strip():  # blank as empty: a blank conninfo would mean libpq's local defaults
        return check_dsn(option)
    env = os.environ.get(ENV_DSN)
    if env and env.strip():
        return check_dsn(env)
    from crest_client.embedded import crest_home, embedded_dsn

    return embedded_dsn(crest_home())
