"""Keep, beside a learned row's tokens, the dense vectors a server computed for them (the live tier's dense part).

Three nullable columns of crest_learned: `dense` holds the projected hidden states of the row's positions
(float16 little-endian, [n, dims]: vector i is the state at row position `dense_first + i`, which predicted the
row's token `dense_first + i + 1`), `dense_first` that first position, and `dense_version` the static store
version whose dense part projected them (its `crest_dense` row: mean, scale, PCA components), so a refresh uses
only vectors projected the way the published static version's queries are. Rows without vectors keep NULL; the
upgrade hands INSERT on the three columns to the roles that may INSERT crest_learned's data columns (the reader
role of `crest db roles`). No pgvector is needed: the vectors are bytes until a refresh loads them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = ("dense_version", "dense_first", "dense")


def _grant_to_appenders(columns: str) -> None:
    """Grant INSERT (columns) on crest_learned to the roles holding a column grant on crest_learned.store."""
    # not the owner: its rights are table-wide
    op.execute(
        f"""
        DO $grant$
        DECLARE
          grantee oid;
        BEGIN
          FOR grantee IN
            SELECT DISTINCT acl.grantee
            FROM pg_attribute AS a, aclexplode(a.attacl) AS acl
            WHERE a.attrelid = 'crest_learned'::regclass AND a.attname = 'store'
              AND acl.privilege_type = 'INSERT' AND acl.grantee <> 0
          LOOP
            EXECUTE format('GRANT INSERT ({columns}) ON TABLE crest_learned TO %I',
                           (SELECT rolname FROM pg_roles WHERE oid = grantee));
          END LOOP;
        END
        $grant$
        """
    )


def upgrade() -> None:
    op.add_column("crest_learned", sa.Column("dense_version", sa.Integer, nullable=True))
    op.add_column("crest_learned", sa.Column("dense_first", sa.Integer, nullable=True))
    op.add_column("crest_learned", sa.Column("dense", sa.LargeBinary, nullable=True))  # [n, dims] float16
    _grant_to_appenders(", ".join(COLUMNS))


def downgrade() -> None:
    for column in reversed(COLUMNS):  # their column grants go with them
        op.drop_column("crest_learned", column)
