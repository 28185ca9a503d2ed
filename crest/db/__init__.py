"""The database: connections and migrations, store versions built and published atomically, roles, the schema."""

from crest.db.versions import (
    Build,
    begin_build,
    clean_leftovers,
    connect,
    drop_store,
    list_stores,
    ngram_table,
    session,
    upgrade,
    vocab_table,
)

__all__ = [
    "Build",
    "begin_build",
    "clean_leftovers",
    "connect",
    "drop_store",
    "list_stores",
    "ngram_table",
    "session",
    "upgrade",
    "vocab_table",
]
