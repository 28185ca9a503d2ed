"""Create stores, partitioned n-gram and vocabulary tables, and the key rendering function.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

# frozen copies: a migration must not change when crest.db.schema does
STATES = ("building", "published", "retired", "failed")
KEY_TOKENS_FUNCTION = """
CREATE OR REPLACE FUNCTION crest_key_tokens(key bytea, width integer) RETURNS integer[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(tok ORDER BY i), '{}')
  FROM (
    SELECT i, (SELECT sum(get_byte(key, i * width + j)::bigint << (8 * (width - 1 - j)))
               FROM generate_series(0, width - 1) AS j)::integer AS tok
    FROM generate_series(0, length(key) / width - 1) AS i
  ) AS t
$$
"""

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "crest_stores",
        sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default="building"),
        sa.Column("tokenizer_fingerprint", sa.Text, nullable=False),
        sa.Column("tokenizer", sa.Text, nullable=False, server_default=""),
        sa.Column("vocab_size", sa.Integer, nullable=False),
        sa.Column("token_width", sa.SmallInteger, nullable=False),
        sa.Column("params", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("figures", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("published_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(f"state IN {STATES!r}", name="crest_stores_state_check"),
        sa.CheckConstraint("name ~ '^[A-Za-z_][A-Za-z0-9_]{0,62}$'", name="crest_stores_name_check"),
    )
    op.create_index(
        "crest_stores_published_name",
        "crest_stores",
        ["name"],
        unique=True,
        postgresql_where=sa.text("state = 'published'"),
    )
    op.create_table(
        "crest_ngrams",
        sa.Column("store_id", sa.Integer, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("n", sa.SmallInteger, nullable=False),
        sa.Column("key", sa.LargeBinary, nullable=False),
        sa.Column("tree", sa.LargeBinary, nullable=False),
        postgresql_partition_by="LIST (store_id)",
    )
    op.create_index("crest_ngrams_key", "crest_ngrams", ["key"], postgresql_using="hash")
    op.create_table(
        "crest_vocab",
        sa.Column("store_id", sa.Integer, nullable=False),
        sa.Column("token_id", sa.Integer, nullable=False),
        sa.Column("piece", sa.Text, nullable=False),
        postgresql_partition_by="LIST (store_id)",
    )
    op.create_index("crest_vocab_token", "crest_vocab", ["store_id", "token_id"], unique=True)
    op.execute(KEY_TOKENS_FUNCTION)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS crest_key_tokens(bytea, integer)")
    op.drop_table("crest_vocab")
    op.drop_table("crest_ngrams")
    op.drop_table("crest_stores")
