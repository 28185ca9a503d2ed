-- The 20 most common stored n-grams of each n in every published store, rendered as text.
-- crest_key_tokens(key, width) unpacks a key into its token ids; crest_vocab maps ids to text pieces.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/top_ngrams.sql
SELECT s.name AS store,
       s.tier,
       g.n,
       g.count,
       string_agg(v.piece, '' ORDER BY t.ord) AS text,
       crest_key_tokens(g.key, s.token_width) AS token_ids
FROM crest_stores AS s
CROSS JOIN generate_series(1, 16) AS ns(n)
JOIN LATERAL (
    SELECT x.key, x.n, x.count
    FROM crest_ngrams AS x
    WHERE x.store_id = s.id AND x.n = ns.n
    ORDER BY x.count DESC, x.key
    LIMIT 20
) AS g ON true
CROSS JOIN LATERAL unnest(crest_key_tokens(g.key, s.token_width)) WITH ORDINALITY AS t(token_id, ord)
JOIN crest_vocab AS v ON v.store_id = s.id AND v.token_id = t.token_id
WHERE s.state = 'published'
GROUP BY s.name, s.tier, g.n, g.count, g.key, s.token_width
ORDER BY s.name, s.tier DESC, g.n, g.count DESC, g.key;
