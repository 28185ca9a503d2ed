"""The database schema, defined with SQLAlchemy Core; Alembic migrations in `migrations/` create it.

`crest_stores` holds one row per store version (state building -> published -> retired, or failed), and
`crest_store_data` what a client loads once per version: the token table that tree blobs' ranks index and the
filter of stored keys. A store name has one published `static` version (built by `crest ingest`) and at most
one published `live` version (built from `crest_learned`, the append-only log of tokens it served, each row
with the figures of the request that served it: forwards, new tokens, accepted draft tokens, and per drafter
part in one jsonb object, so that a new part needs no migration).
`crest_ngrams` and `crest_vocab` are partitioned by store version: an ingest fills stand-alone tables and
attaches them as partitions in the same transaction that publishes the version, so readers see either the
previous version or the new one, never a partial one, and an old version is dropped as a whole.
"""

from __future__ import annotations

import sqlalchemy as sa
from crest_client.learner import STATS as LEARNED_STATS
from crest_client.tiers import TIERS
from sqlalchemy.dialects import postgresql as pg

metadata = sa.MetaData()

STATES = ("building", "published", "retired", "failed")

stores = sa.Table(
    "crest_stores",
    metadata,
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
    sa.Column("tier", sa.Text, nullable=False, server_default="static"),
    sa.CheckConstraint(f"state IN {STATES!r}", name="crest_stores_state_check"),
    sa.CheckConstraint("name ~ '^[A-Za-z_][A-Za-z0-9_]{0,62}$'", name="crest_stores_name_check"),
    sa.CheckConstraint(f"tier IN {TIERS!r}", name="crest_stores_tier_check"),
)
sa.Index(
    "crest_stores_published_name",
    stores.c.name,
    stores.c.tier,
    unique=True,
    postgresql_where=stores.c.state == "published",
)

ngrams = sa.Table(
    "crest_ngrams",
    metadata,
    sa.Column("store_id", sa.Integer, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),  # occurrences in the corpus
    sa.Column("n", sa.SmallInteger, nullable=False),
    sa.Column("key", sa.LargeBinary, nullable=False),  # the n token ids, big-endian, store.token_width bytes each
    sa.Column("tree", sa.LargeBinary, nullable=False),  # crest_client.codec blob
    postgresql_partition_by="LIST (store_id)",
)
sa.Index("crest_ngrams_key", ngrams.c.key, postgresql_using="hash")

store_data = sa.Table(
    "crest_store_data",
    metadata,
    sa.Column("store_id", sa.Integer, sa.ForeignKey("crest_stores.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("token_table", sa.LargeBinary, nullable=False),  # crest_client.codec.TokenTable: ids by rank
    sa.Column("key_filter", sa.LargeBinary),  # crest_client.keyfilter.KeyFilter over every stored key
)

vocab = sa.Table(
    "crest_vocab",
    metadata,
    sa.Column("store_id", sa.Integer, nullable=False),
    sa.Column("token_id", sa.Integer, nullable=False),
    sa.Column("piece", sa.Text, nullable=False),
    postgresql_partition_by="LIST (store_id)",
)
sa.Index("crest_vocab_token", vocab.c.store_id, vocab.c.token_id, unique=True)

learned = sa.Table(
    "crest_learned",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("store", sa.Text, nullable=False),  # the store name (the tenant)
    sa.Column("tokens", sa.LargeBinary, nullable=False),  # token ids, little-endian uint32
    sa.Column("n_tokens", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),  # leading ids that were context
    sa.Column("source", sa.Text, nullable=False, server_default=""),  # a server id, 'file', 'sdk'
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    # the figures of the request that served the row (crest_client.learner.STATS), 0 when not given
    *(sa.Column(name, sa.Integer, nullable=False, server_default="0") for name in LEARNED_STATS),
    # part name -> accepted tokens that part's tree held along the accepted path (only non-zero ones)
    sa.Column("accepted_parts", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # the row's positions' hidden states, projected by static version dense_version's dense part (float16
    # [n, dims], the first at row position dense_first; crest_client.learner.DENSE), NULL when not recorded
    sa.Column("dense_version", sa.Integer, nullable=True),
    sa.Column("dense_first", sa.Integer, nullable=True),
    sa.Column("dense", sa.LargeBinary, nullable=True),
)
sa.Index("crest_learned_store_id", learned.c.store, learned.c.id)

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
