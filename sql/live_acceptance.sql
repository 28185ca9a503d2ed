-- How often each part of the served drafts was accepted, per store: over all time (period NULL) and per day.
-- A served request's learned row says how it went: target forwards (steps), new tokens, draft nodes verified
-- and accepted, and how many accepted tokens each part's tree held along the accepted path before the parts
-- were merged: the static tier, the live tier (what the store learned) and the prompt lookup (from the row's
-- accepted_parts; part_acceptance.sql lists every part, new ones included). A token two parts both held
-- counts for both, so the parts' figures may add up to more than accepted_tokens. Rows
-- written without figures (`crest learn FILE`, an SDK `learn` without stats) have steps = 0 and are left out.
-- M = new tokens per step; *_per_step = accepted tokens per step; *_share = accepted tokens / new tokens.
-- Per hour instead of per day: set unit to 'hour' below.
-- Usage: psql "$CREST_DATABASE_URL" -f sql/live_acceptance.sql
WITH params AS (
  SELECT 'day'::text AS unit
), served AS (
  SELECT l.store, date_trunc(p.unit, l.created_at) AS period, l.steps, l.new_tokens, l.draft_tokens,
         l.accepted_tokens,
         coalesce((l.accepted_parts ->> 'static')::bigint, 0) AS accepted_static,
         coalesce((l.accepted_parts ->> 'live')::bigint, 0) AS accepted_live,
         coalesce((l.accepted_parts ->> 'prompt')::bigint, 0) AS accepted_prompt
  FROM crest_learned AS l CROSS JOIN params AS p
  WHERE l.steps > 0
), totals AS (
  SELECT store, period, GROUPING(period) = 1 AS overall,
         count(*) AS requests,
         sum(new_tokens)::bigint AS new_tokens,
         sum(steps)::bigint AS steps,
         sum(draft_tokens)::bigint AS draft_tokens,
         sum(accepted_tokens)::bigint AS accepted_tokens,
         sum(accepted_static)::bigint AS accepted_static,
         sum(accepted_live)::bigint AS accepted_live,
         sum(accepted_prompt)::bigint AS accepted_prompt
  FROM served
  GROUP BY GROUPING SETS ((store), (store, period))
)
SELECT store, period, requests, new_tokens, steps,
       round(new_tokens::numeric / steps, 3) AS m,
       draft_tokens, accepted_tokens,
       round(accepted_tokens::numeric / nullif(draft_tokens, 0), 3) AS accepted_of_drafted,
       accepted_static, accepted_live, accepted_prompt,
       round(accepted_tokens::numeric / steps, 3) AS accepted_per_step,
       round(accepted_static::numeric / steps, 3) AS static_per_step,
       round(accepted_live::numeric / steps, 3) AS live_per_step,
       round(accepted_prompt::numeric / steps, 3) AS prompt_per_step,
       round(accepted_static::numeric / nullif(new_tokens, 0), 3) AS static_share,
       round(accepted_live::numeric / nullif(new_tokens, 0), 3) AS live_share,
       round(accepted_prompt::numeric / nullif(new_tokens, 0), 3) AS prompt_share
FROM totals
ORDER BY store, overall DESC, period;
