"""Keep a learned row's accepted tokens per part in one jsonb column, so that a new drafter part needs no migration.

`accepted_parts` maps a part's name to the accepted tokens that part's tree held along the accepted path
(only parts with some: `{}` when none or when the row has no figures). The upgrade fills it from
`accepted_static`, `accepted_live` and `accepted_prompt`, hands INSERT on it to the roles that may INSERT
crest_learned's data columns (the reader role of `crest db roles`), and drops the three columns. The
downgrade restores them from the jsonb (parts other than these three are lost) with the same grants.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

# frozen copy: the parts migration 0004 gave a column each
PARTS = ("static", "live", "prompt")

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


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
    op.add_column(
        "crest_learned",
        sa.Column("accepted_parts", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    pairs = ", ".join(f"'{part}', nullif(accepted_{part}, 0)" for part in PARTS)
    op.execute(
        f"UPDATE crest_learned SET accepted_parts = jsonb_strip_nulls(jsonb_build_object({pairs}))"
        f" WHERE {' OR '.join(f'accepted_{part} <> 0' for part in PARTS)}"
    )
    _grant_to_appenders("accepted_parts")
    for part in PARTS:  # their column grants go with them
        op.drop_column("crest_learned", f"accepted_{part}")


def downgrade() -> None:
    for part in PARTS:
        op.add_column("crest_learned", sa.Column(f"accepted_{part}", sa.Integer, nullable=False, server_default="0"))
    sets = ", ".join(f"accepted_{part} = coalesce((accepted_parts ->> '{part}')::integer, 0)" for part in PARTS)
    op.execute(f"UPDATE crest_learned SET {sets} WHERE accepted_parts <> '{{}}'::jsonb")
    _grant_to_appenders(", ".join(f"accepted_{part}" for part in PARTS))
    op.drop_column("crest_learned", "accepted_parts")
