-- tallyd.rollup_sketches: last changed by migrations/V12__counter_kinds.sql (changed in V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The fold of unique counters' slot rows: up to batch_rows of them (not of the counters in
-- `kept`, which fold into an application's table), claimed and key-locked as every rollup step
-- claims rows, deleted, and their sketches unioned (hll_union_agg) into `rollups`. Dynamic
-- statements, so that this function exists, and tallyd.rollup_fold calls it, only where the hll
-- extension is installed. Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_sketches(slots regclass, rollups regclass, batch_rows integer, kept text[])
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    folded bigint;
BEGIN
    EXECUTE format($q$
        WITH claimed AS (
            SELECT s.counter, s.key, s.span, s.win, s.slot FROM %1$s s
            WHERE s.sketch IS NOT NULL
              AND s.counter || E'\n' || s.span <> ALL ($2)
            LIMIT $1
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT * FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
        ), removed AS (
            DELETE FROM %1$s s
            USING owned o
            WHERE s.counter = o.counter AND s.key = o.key AND s.span = o.span
              AND s.win = o.win AND s.slot = o.slot
            RETURNING s.counter, s.key, s.span, s.win, s.count, s.first_seen, s.last_seen, s.sketch
        ), sums AS (
            SELECT counter, key, span, win, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
                   hll_union_agg(sketch::hll) AS sketch
            FROM removed GROUP BY counter, key, span, win
        ), added AS (
            INSERT INTO %2$s AS r (counter, key, span, win, count, first_seen, last_seen, kind, sketch)
            SELECT counter, key, span, win, count, first_seen, last_seen, 'unique',
                   hll_send(sketch)
            FROM sums
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen),
                sketch = hll_send(hll_union(r.sketch::hll, EXCLUDED.sketch::hll))
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$, slots, rollups) INTO folded USING batch_rows, kept;
    RETURN folded;
END
$function$;
