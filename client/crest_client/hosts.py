"""Where readers connect: the read DSN rule, and DSNs that name several servers (replicas, then the primary).

Inference servers read stores from replicas while ingest and learning write to the primary. A reader's DSN is
the one its caller gives (`--read-dsn`, else `--dsn`), else `CREST_READ_DATABASE_URL`, else the writers'
`CREST_DATABASE_URL`, else the embedded default. Any DSN may name several servers as libpq does
(`host=a,b port=5432,5433`, or `postgresql://a:5432,b:5433/db`) with `target_session_attrs` and
`load_balance_hosts`: each new connection tries the servers in order (or shuffled) and keeps the first that
answers and qualifies, so a pool whose server went away reconnects to another. `check_dsn` refuses, before any
connection, a DSN that would only ever fail (a typo is an error, not a database that seems down).
"""

from __future__ import annotations

import os

from crest_client._dsn import LOAD_BALANCE, SESSION_ATTRS, check_dsn, hosts
from crest_client.names import ENV_DSN, resolve_dsn

ENV_READ_DSN = "CREST_READ_DATABASE_URL"

__all__ = ["ENV_DSN", "ENV_READ_DSN", "LOAD_BALANCE", "SESSION_ATTRS", "check_dsn", "hosts", "resolve_read_dsn"]


def resolve_read_dsn(read: str | None = None, *, dsn: str | None = None) -> str:
    """Return the readers' DSN: `read`, else `dsn`, else CREST_READ_DATABASE_URL, else resolve_dsn()."""
    given = read or dsn or os.environ.get(ENV_READ_DSN)
    return given if given else resolve_dsn(None)
