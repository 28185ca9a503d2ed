"""Alembic environment: runs crest's migrations on the connection handed over by `crest.db.upgrade`."""

from __future__ import annotations

from alembic import context

from crest.db.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("crest migrations run through `crest db upgrade` (crest.db.upgrade), not bare alembic")
context.configure(connection=connection, target_metadata=metadata, version_table="crest_alembic_version")
with context.begin_transaction():
    context.run_migrations()
