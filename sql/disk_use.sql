-- Disk use of every store version: n-gram table, its hash index, the token table and key filter clients load,
-- the vocabulary, bytes per stored n-gram (table + index + token table + key filter), and the bytes of what
-- the store learned (its share of crest_learned with its index; the same figure on each version of a store).
-- Usage: psql "$CREST_DATABASE_URL" -f sql/disk_use.sql
SELECT s.name AS store,
       s.id AS version,
       s.tier,
       s.state,
       c.reltuples::bigint AS ngrams_estimate,
       pg_table_size(c.oid) AS table_bytes,
       pg_indexes_size(c.oid) AS index_bytes,
       coalesce(d.bytes, 0) AS client_data_bytes,
       coalesce(pg_total_relation_size(to_regclass('crest_vocab_s' || s.id)), 0) AS vocab_bytes,
       pg_size_pretty(pg_total_relation_size(c.oid) + coalesce(d.bytes, 0)) AS ngrams_total,
       round((pg_total_relation_size(c.oid) + coalesce(d.bytes, 0))::numeric
             / nullif((SELECT count(*) FROM crest_ngrams AS g WHERE g.store_id = s.id), 0), 1) AS bytes_per_ngram,
       coalesce(l.bytes, 0) AS learned_bytes
FROM crest_stores AS s
JOIN pg_class AS c ON c.oid = to_regclass('crest_ngrams_s' || s.id)
LEFT JOIN (SELECT store_id, pg_column_size(token_table) + coalesce(pg_column_size(key_filter), 0) AS bytes
           FROM crest_store_data) AS d ON d.store_id = s.id
LEFT JOIN (SELECT store,
                  (pg_total_relation_size('crest_learned') * sum(pg_column_size(crest_learned.*))
                   / nullif(sum(sum(pg_column_size(crest_learned.*))) OVER (), 0))::bigint AS bytes
           FROM crest_learned GROUP BY store) AS l ON l.store = s.name
ORDER BY s.name, s.tier DESC, s.id;
