"""Add crest_dense: the dense part of a store version (DReSD), its projection and the model it was built with.

One row per store version that has a dense part: the model it was embedded with (its spec and fingerprint), the
projection applied to every hidden state (mean, scale and the PCA components, float32 bytes), the embedding and
continuation lengths and the build's figures. The vectors themselves live in a stand-alone table per version,
`crest_dense_s<ID>` (pgvector, HNSW index), created by the build, dropped with the version; this migration needs
no pgvector, so databases without the extension still migrate (only a dense build needs it).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "crest_dense",
        sa.Column("store_id", sa.Integer, sa.ForeignKey("crest_stores.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("model_fingerprint", sa.Text, nullable=False),
        sa.Column("hidden_size", sa.Integer, nullable=False),
        sa.Column("dims", sa.SmallInteger, nullable=False),
        sa.Column("continuation", sa.SmallInteger, nullable=False),
        sa.Column("mean", sa.LargeBinary, nullable=False),  # [H] float32
        sa.Column("scale", sa.LargeBinary, nullable=False),  # [H] float32: 1 / standard deviation
        sa.Column("components", sa.LargeBinary, nullable=False),  # [H, dims] float32
        sa.Column("figures", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )


def downgrade() -> None:
    op.execute(
        "DO $drop$ DECLARE sid integer; BEGIN FOR sid IN SELECT store_id FROM crest_dense LOOP"
        " EXECUTE format('DROP TABLE IF EXISTS %I', 'crest_dense_s' || sid); END LOOP; END $drop$"
    )
    op.drop_table("crest_dense")
