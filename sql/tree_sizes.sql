-- Distribution of tree sizes (nodes per stored n-gram) of every published store, per n.
-- The node count is read from the blob header (byte 2, or bytes 2-3 little-endian when flag bit 7 is set),
-- so no decoding is needed.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/tree_sizes.sql
WITH sizes AS (
    SELECT s.name, s.tier, g.n,
           CASE WHEN get_byte(g.tree, 1) & 128 = 0 THEN get_byte(g.tree, 2)
                ELSE get_byte(g.tree, 2) + 256 * get_byte(g.tree, 3) END AS nodes,
           length(g.tree) AS blob_bytes
    FROM crest_stores AS s
    JOIN crest_ngrams AS g ON g.store_id = s.id
    WHERE s.state = 'published'
)
SELECT name AS store,
       tier,
       n,
       count(*) AS ngrams,
       round(avg(nodes), 2) AS avg_nodes,
       min(nodes) AS min_nodes,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY nodes) AS median_nodes,
       max(nodes) AS max_nodes,
       count(*) FILTER (WHERE nodes <= 4) AS nodes_1_4,
       count(*) FILTER (WHERE nodes BETWEEN 5 AND 16) AS nodes_5_16,
       count(*) FILTER (WHERE nodes BETWEEN 17 AND 63) AS nodes_17_63,
       count(*) FILTER (WHERE nodes >= 64) AS nodes_64_up,
       round(avg(blob_bytes), 1) AS avg_blob_bytes
FROM sizes
GROUP BY name, tier, n
ORDER BY name, tier DESC, n;
