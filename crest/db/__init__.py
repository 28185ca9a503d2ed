"""The database: connections and migrations, store versions built and published atomically, roles, the schema."""

from crest.db._tables import ngram_table, vocab_table
from crest.db.build import Build, begin_build
from crest.db.connection import connect, session, upgrade
from crest.db.versions import clean_leftovers, drop_store, list_stores

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
