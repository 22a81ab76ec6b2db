-- tallyd.unique_totals: created at start by src/store/kinds.rs (UNIQUE_TOTALS), not by a migration
-- Read-only copy: change it in src/store/kinds.rs, then here; tests/schema.rs compares the two.
--
-- Made (CREATE OR REPLACE, at every start with database.migrate = true, or `tallyd migrate`)
-- only where a unique counter is declared, after `CREATE EXTENSION IF NOT EXISTS hll`: it needs
-- the extension's functions, and tallyd's tables need the extension nowhere else (sketches are
-- stored as bytea). One row per (counter, key, span, window) of the unique counters: the union
-- of its slot and rollup rows' sketches, exact at any moment as tallyd.totals is, the estimated
-- number of distinct values and the number of events. Dropped when src/store/mod.rs rebuilds
-- tallyd.slots for slot_partitions, and made again by the same start.
CREATE OR REPLACE VIEW tallyd.unique_totals AS
SELECT counter, key, span, win AS window_start,
       hll_union_agg(sketch::hll) AS sketch,
       round(hll_cardinality(hll_union_agg(sketch::hll)))::bigint AS cardinality,
       sum(count) AS events,
       min(first_seen) AS first_seen,
       max(last_seen) AS last_seen
FROM (
    SELECT counter, key, span, win, sketch, count, first_seen, last_seen
    FROM tallyd.rollups WHERE sketch IS NOT NULL
    UNION ALL
    SELECT counter, key, span, win, sketch, count, first_seen, last_seen
    FROM tallyd.slots WHERE sketch IS NOT NULL
) AS parts
GROUP BY counter, key, span, win;
