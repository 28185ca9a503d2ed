"""Add a learned row's figures of the request that served it: forwards, tokens, and accepted tokens per part.

Each is an integer, 0 for rows written without figures (`crest learn FILE`, older servers and SDKs). Roles
that may INSERT crest_learned's data columns (the reader role of `crest db roles`) may INSERT these too, so a
server keeps learning across the upgrade without the roles being set up again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# frozen copy: a migration must not change when crest_client.learner.STATS does
STATS = (
    "steps",
    "new_tokens",
    "draft_tokens",
    "accepted_tokens",
    "accepted_static",
    "accepted_live",
    "accepted_prompt",
)

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for name in STATS:
        op.add_column("crest_learned", sa.Column(name, sa.Integer, nullable=False, server_default="0"))
    # the roles holding a column grant on crest_learned.store (not the owner: its rights are table-wide)
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
            EXECUTE format('GRANT INSERT ({", ".join(STATS)}) ON TABLE crest_learned TO %I',
                           (SELECT rolname FROM pg_roles WHERE oid = grantee));
          END LOOP;
        END
        $grant$
        """
    )


def downgrade() -> None:
    for name in reversed(STATS):
        op.drop_column("crest_learned", name)
