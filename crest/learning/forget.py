"""Forgetting what a store learned: its learned rows (all, or those created before a time) and its live versions.

`forget` waits for the store's refresh lock, so no refresh can publish a live version built from rows it is
deleting; then, in one transaction, deletes the rows and retires every live version of the store (a live
version may hold n-grams of any row in its window), and drops their tables. The static version stays. The
next refresh rebuilds the live tier from the rows that are left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from crest import db
from crest.config import check_store_name
from crest.db.versions import refresh_lock_key
from crest.errors import StoreNotFound


@dataclass
class ForgetResult:
    """What `forget` removed: learned rows and the ids of the live versions dropped."""

    store: str
    rows: int
    versions: list[int] = field(default_factory=list)


def forget(dsn: str, store: str, *, before: datetime | None = None) -> ForgetResult:
    """Delete the store's learned rows (created before `before`, or all) and drop every live version of it."""
    check_store_name(store)
    if before is not None and before.tzinfo is None:
        before = before.astimezone()  # a naive time is local time
    key = refresh_lock_key(store)
    with db.session(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s, %s)", key)  # waits for a running refresh of the store
        try:
            with conn.transaction():
                deleted = conn.execute(
                    "DELETE FROM crest_learned WHERE store = %s AND (%s::timestamptz IS NULL OR created_at < %s)",
                    (store, before, before),
                ).rowcount
                versions = [
                    int(sid)
                    for (sid,) in conn.execute(
                        "UPDATE crest_stores SET state = 'retired' WHERE name = %s AND tier = 'live'"
                        " AND state = 'published' RETURNING id",
                        (store,),
                    )
                ]
                known = conn.execute("SELECT 1 FROM crest_stores WHERE name = %s LIMIT 1", (store,)).fetchone()
                if not (deleted or versions or known):
                    raise StoreNotFound(f"no store named {store!r} and nothing learned for it")
            db.clean_leftovers(conn, name=store, tier="live")
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", key)
    return ForgetResult(store=store, rows=max(0, deleted), versions=versions)
