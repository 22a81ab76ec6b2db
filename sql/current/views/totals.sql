-- tallyd.totals: last changed by migrations/V12__counter_kinds.sql (changed in V1, V5, V10, V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md); tests/schema.rs
-- compares the two.
--
-- What applications read: each counter's all-time total per key, exact at any moment, as what
-- is rolled up (tallyd.rollups) plus what is still in slots (tallyd.slots), of the rows with
-- span 'all'. A statement reads both branches in one snapshot, and every flush and rollup step
-- moves rows between them in one transaction. Filters on counter and key are pushed into both
-- branches, so a lookup of one key stays two index scans.
-- - count: bigint, NULL for the rare key whose total leaves the 64-bit range (V5);
--   exact_count, numeric, always holds it.
-- - kind, value (V12): 'sum', or a max, min or last counter's kind and its value, merged as the
--   flush's upserts and the rollup fold merge them (greatest, least, latest last_seen and at
--   equal times the largest value).
-- src/store/mod.rs (VIEWS_OF_SLOTS) drops and recreates it, from its pg_get_viewdef, when it
-- rebuilds tallyd.slots for slot_partitions.
CREATE OR REPLACE VIEW tallyd.totals AS
SELECT counter, key,
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
    SELECT counter, key, count, first_seen, last_seen, kind, value FROM tallyd.rollups WHERE span = 'all'
    UNION ALL
    SELECT counter, key, count, first_seen, last_seen, kind, value FROM tallyd.slots WHERE span = 'all'
) AS parts
GROUP BY counter, key;
