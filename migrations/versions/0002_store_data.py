"""Add crest_store_data: per-version token table (tree blobs store token ranks) and key filter.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "crest_store_data",
        sa.Column("store_id", sa.Integer, sa.ForeignKey("crest_stores.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("token_table", sa.LargeBinary, nullable=False),
        sa.Column("key_filter", sa.LargeBinary),
    )


def downgrade() -> None:
    op.drop_table("crest_store_data")
