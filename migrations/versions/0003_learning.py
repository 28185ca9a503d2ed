"""Add store tiers (static, live) and crest_learned, the append-only log of served tokens.

A store name has one published static version (from `crest ingest`) and at most one published live version
(built from what was learned), so the unique published index moves from (name) to (name, tier).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# frozen copy: a migration must not change when crest.db.schema does
TIERS = ("static", "live")

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("crest_stores", sa.Column("tier", sa.Text, nullable=False, server_default="static"))
    op.create_check_constraint("crest_stores_tier_check", "crest_stores", f"tier IN {TIERS!r}")
    op.drop_index("crest_stores_published_name", table_name="crest_stores")
    op.create_index(
        "crest_stores_published_name",
        "crest_stores",
        ["name", "tier"],
        unique=True,
        postgresql_where=sa.text("state = 'published'"),
    )
    op.create_table(
        "crest_learned",
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("store", sa.Text, nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("source", sa.Text, nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("crest_learned_store_id", "crest_learned", ["store", "id"])


def downgrade() -> None:
    op.drop_table("crest_learned")
    # live versions become retired ones: the next clean-up drops their tables
    op.execute("UPDATE crest_stores SET state = 'retired' WHERE tier = 'live' AND state = 'published'")
    op.drop_index("crest_stores_published_name", table_name="crest_stores")
    op.create_index(
        "crest_stores_published_name",
        "crest_stores",
        ["name"],
        unique=True,
        postgresql_where=sa.text("state = 'published'"),
    )
    op.drop_constraint("crest_stores_tier_check", "crest_stores", type_="check")
    op.drop_column("crest_stores", "tier")
