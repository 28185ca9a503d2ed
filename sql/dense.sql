-- The dense part of every store version that has one (crest ingest --dense-model): the model it was built with,
-- vector dimensions, precision (the embedding column's type: halfvec = half, vector = single) and continuation
-- length, rows, the pgvector table's and ANN index's bytes, bytes per row.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/dense.sql
SELECT s.name AS store,
       s.id AS version,
       s.tier,
       s.state,
       d.model,
       d.model_fingerprint,
       d.dims,
       (SELECT CASE t.typname WHEN 'halfvec' THEN 'half' ELSE 'single' END
          FROM pg_attribute AS a JOIN pg_type AS t ON t.oid = a.atttypid
         WHERE a.attrelid = c.oid AND a.attname = 'embedding') AS precision,
       d.continuation,
       coalesce(d.figures -> 'index' ->> 'kind', 'hnsw') AS index_kind,  -- parts built before the choice: hnsw
       c.reltuples::bigint AS rows_estimate,
       pg_table_size(c.oid) AS table_bytes,
       pg_indexes_size(c.oid) AS index_bytes,
       pg_size_pretty(pg_total_relation_size(c.oid)) AS total,
       round(pg_total_relation_size(c.oid)::numeric / nullif((d.figures ->> 'rows')::bigint, 0), 1) AS bytes_per_row
FROM crest_dense AS d
JOIN crest_stores AS s ON s.id = d.store_id
JOIN pg_class AS c ON c.oid = to_regclass('crest_dense_s' || d.store_id)
ORDER BY s.name, s.tier DESC, s.id;
