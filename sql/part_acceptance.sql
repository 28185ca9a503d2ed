-- How many accepted tokens each drafter part held, per store and part: over all time (period NULL) and per day.
-- One row per (store, period, part) of the served requests' accepted_parts (part name -> accepted tokens
-- that part's tree held along the accepted path), so a part added later (a new drafter) shows up with no
-- change here. requests, steps, new_tokens and accepted_tokens are those of every served request of the
-- store in the period; part_requests counts the requests in which the part held at least one accepted token.
-- per_step = the part's accepted tokens per step; share = of new tokens; of_accepted = of accepted draft
-- tokens (a token two parts both held counts for both). Rows written without figures (steps = 0) are left out.
-- Per hour instead of per day: set unit to 'hour' below.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/part_acceptance.sql
WITH params AS (
  SELECT 'day'::text AS unit
), served AS (
  SELECT l.store, date_trunc(p.unit, l.created_at) AS period, l.steps, l.new_tokens, l.accepted_tokens,
         l.accepted_parts
  FROM crest_learned AS l CROSS JOIN params AS p
  WHERE l.steps > 0
), totals AS (
  SELECT store, period, GROUPING(period) = 1 AS overall,
         count(*) AS requests,
         sum(steps)::bigint AS steps,
         sum(new_tokens)::bigint AS new_tokens,
         sum(accepted_tokens)::bigint AS accepted_tokens
  FROM served
  GROUP BY GROUPING SETS ((store), (store, period))
), parts AS (
  SELECT s.store, s.period, GROUPING(s.period) = 1 AS overall, e.key AS part,
         count(*) FILTER (WHERE e.value::bigint > 0) AS part_requests,
         sum(e.value::bigint)::bigint AS part_tokens
  FROM served AS s CROSS JOIN LATERAL jsonb_each_text(s.accepted_parts) AS e
  GROUP BY GROUPING SETS ((s.store, e.key), (s.store, s.period, e.key))
)
SELECT p.store, p.period, p.part, t.requests, t.steps, t.new_tokens, t.accepted_tokens,
       p.part_requests, p.part_tokens,
       round(p.part_tokens::numeric / t.steps, 3) AS per_step,
       round(p.part_tokens::numeric / nullif(t.new_tokens, 0), 3) AS share,
       round(p.part_tokens::numeric / nullif(t.accepted_tokens, 0), 3) AS of_accepted
FROM parts AS p
JOIN totals AS t ON t.store = p.store AND t.overall = p.overall AND t.period IS NOT DISTINCT FROM p.period
ORDER BY p.store, p.overall DESC, p.period, p.part;
