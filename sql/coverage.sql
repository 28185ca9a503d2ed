-- Coverage per n of every published store.
-- For each n: how many distinct n-grams the corpus had (counted), how many the store kept, and the share of
-- corpus positions (n-gram occurrences) whose n-token suffix is stored, i.e. where a lookup of that length hits.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/coverage.sql
SELECT s.name AS store,
       s.tier,
       g.n,
       (s.figures -> 'counted' ->> g.n::text)::bigint AS counted,
       count(*) AS kept,
       round(100.0 * count(*) / nullif((s.figures -> 'counted' ->> g.n::text)::bigint, 0), 3) AS kept_pct,
       sum(g.count) AS covered_positions,
       (s.figures -> 'positions' ->> g.n::text)::bigint AS positions,
       round(100.0 * sum(g.count) / nullif((s.figures -> 'positions' ->> g.n::text)::bigint, 0), 2) AS covered_pct
FROM crest_stores AS s
JOIN crest_ngrams AS g ON g.store_id = s.id
WHERE s.state = 'published'
GROUP BY s.name, s.tier, s.figures, g.n
ORDER BY s.name, s.tier DESC, g.n;
