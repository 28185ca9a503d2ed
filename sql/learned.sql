-- What each store learned from what it served: rows, tokens (prompt context included), bytes on disk, first and
-- last append, and the published live version built from it with its window of learned row ids. Rows newer than
-- through_id are not in the live version yet (the next `crest refresh` or server refresh builds them in).
-- Usage: psql "$CREST_DATABASE_URL" -f sql/learned.sql
WITH learned AS (
  SELECT store,
         count(*) AS rows,
         sum(n_tokens)::bigint AS tokens,
         sum(prompt_tokens)::bigint AS prompt_tokens,
         sum(pg_column_size(crest_learned.*)) AS row_bytes,
         min(created_at) AS first_at,
         max(created_at) AS last_at
  FROM crest_learned
  GROUP BY store
), names AS (
  SELECT store AS name FROM learned
  UNION
  SELECT name FROM crest_stores WHERE state = 'published'
)
SELECT n.name AS store,
       coalesce(l.rows, 0) AS rows,
       coalesce(l.tokens, 0) AS tokens,
       coalesce(l.prompt_tokens, 0) AS prompt_tokens,
       coalesce((pg_total_relation_size('crest_learned') * l.row_bytes
                 / nullif(sum(l.row_bytes) OVER (), 0))::bigint, 0) AS bytes,
       l.first_at,
       l.last_at,
       v.id AS live_version,
       (v.params ->> 'from_id')::bigint AS from_id,
       (v.params ->> 'through_id')::bigint AS through_id,
       (v.params ->> 'window')::bigint AS window_tokens,
       (v.figures ->> 'tokens')::bigint AS live_tokens,
       v.published_at AS live_published_at,
       (SELECT count(*) FROM crest_learned AS r
        WHERE r.store = n.name AND r.id > coalesce((v.params ->> 'through_id')::bigint, 0)) AS rows_not_live
FROM names AS n
LEFT JOIN learned AS l ON l.store = n.name
LEFT JOIN crest_stores AS v ON v.name = n.name AND v.tier = 'live' AND v.state = 'published'
ORDER BY n.name;
