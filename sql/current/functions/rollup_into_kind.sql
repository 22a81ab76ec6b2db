-- tallyd.rollup_into_kind: last changed by migrations/V12__counter_kinds.sql (changed in V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- rollup_into for a max, min or unique counter (all-time counters; src/config/counters.rs refuses
-- the others): the target's column keeps the greatest (max), least (min) or the union (unique: an
-- hll column) of its own value and the key's folded slot rows. Claimed, key-locked and limited to
-- keys with a target row, as tallyd.rollup_into_shard does for sums; the column is bigint or
-- numeric for max and min (src/store/targets.rs checks), so no value leaves its range. Returns
-- the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_into_kind(slots regclass, counter text, target regclass, key_column name, value_column name, key_type text, kind text, batch_rows integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    n bigint;
    agg text := CASE kind WHEN 'max' THEN 'max(value)' WHEN 'min' THEN 'min(value)'
                          WHEN 'unique' THEN 'hll_union_agg(sketch::hll)' END;
    merged text := CASE kind
        WHEN 'max' THEN format('GREATEST(u.%I, sums.v)', value_column)
        WHEN 'min' THEN format('LEAST(u.%I, sums.v)', value_column)
        WHEN 'unique' THEN format('CASE WHEN u.%1$I IS NULL THEN sums.v ELSE hll_union(u.%1$I, sums.v) END',
                                  value_column) END;
BEGIN
    IF agg IS NULL THEN
        RAISE EXCEPTION 'tallyd.rollup_into_kind: kind % cannot fold into a column', kind;
    END IF;
    EXECUTE format($step$
        WITH claimed AS (
            SELECT s.key, s.slot FROM %5$s s
            WHERE s.counter = $1
              AND EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%4$s)
            LIMIT $2
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT key, slot FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext($1 || E'\n' || key))
        ), targets AS (
            SELECT u.%2$I AS k FROM %1$s u
            WHERE u.%2$I IN (SELECT key::%4$s FROM owned)
            FOR NO KEY UPDATE OF u SKIP LOCKED
        ), folding AS (
            SELECT o.key, o.slot FROM owned o WHERE o.key::%4$s IN (SELECT k FROM targets)
        ), removed AS (
            DELETE FROM %5$s s USING folding f
            WHERE s.counter = $1 AND s.key = f.key AND s.slot = f.slot
            RETURNING s.key, s.value, s.sketch
        ), sums AS (
            SELECT key::%4$s AS k, %6$s AS v, count(*) AS n FROM removed GROUP BY 1
        ), updated AS (
            UPDATE %1$s u SET %3$I = %7$s FROM sums WHERE u.%2$I = sums.k
        )
        SELECT coalesce(sum(n), 0) FROM sums
    $step$, target, key_column, value_column, key_type, slots, agg, merged)
    INTO n USING counter, batch_rows;
    RETURN n;
END
$function$;
