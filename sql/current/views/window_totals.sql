-- tallyd.window_totals: last changed by migrations/V12__counter_kinds.sql (changed in V10, V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md); tests/schema.rs
-- compares the two.
--
-- tallyd.totals (views/totals.sql) for the windowed rows: one row per (counter, key, span,
-- window), exact at any moment in the same way. `window_start` is the window's first instant;
-- `window_start AT TIME ZONE '<the counter's time_zone>'` gives its local start, and `::date` of
-- that its first day. kind and value as in tallyd.totals (V12).
-- src/store/mod.rs (VIEWS_OF_SLOTS) drops and recreates it, from its pg_get_viewdef, when it
-- rebuilds tallyd.slots for slot_partitions.
CREATE OR REPLACE VIEW tallyd.window_totals AS
SELECT counter, key, span, win AS window_start,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count,
       coalesce(min(kind), 'sum') AS kind,
       CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
            WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                              FILTER (WHERE kind = 'last'))[1] END AS value
FROM (
    SELECT counter, key, span, win, count, first_seen, last_seen, kind, value FROM tallyd.rollups WHERE span <> 'all'
    UNION ALL
    SELECT counter, key, span, win, count, first_seen, last_seen, kind, value FROM tallyd.slots WHERE span <> 'all'
) AS parts
GROUP BY counter, key, span, win;
