-- tallyd.rollup_into_shard: last changed by migrations/V6__citus_rollup.sql (changed in V6)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The fold of a sum's all-time rollup_into target for one counter, optionally for one key only,
-- over the given slots and rollup_rejects relations: up to batch_rows slot rows of keys that
-- have a row in the target, claimed (FOR UPDATE SKIP LOCKED), kept for the keys whose advisory
-- lock is free, kept again only where this step can lock the target's row (FOR NO KEY UPDATE SKIP
-- LOCKED: a row the application holds is left to a later step), deleted, and their sums added to
-- the target's column. Raises numeric_value_out_of_range when a key's column would leave its
-- type's range (tallyd.rollup_shard then goes key by key). Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_into_shard(slots regclass, rejects regclass, counter text, target regclass, key_column name, count_column name, key_type text, batch_rows integer, only_key text)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    n bigint;
BEGIN
    EXECUTE format($step$
        WITH claimed AS (
            SELECT s.key, s.slot FROM %5$s s
            WHERE s.counter = $1
              AND ($3::text IS NULL OR s.key = $3)
              AND NOT EXISTS (SELECT 1 FROM %6$s j
                              WHERE j.counter = s.counter AND j.key = s.key)
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
            RETURNING s.key, s.count
        ), sums AS (
            SELECT key::%4$s AS k, sum(count)::bigint AS count, count(*) AS n
            FROM removed GROUP BY 1
        ), updated AS (
            UPDATE %1$s u SET %3$I = coalesce(u.%3$I, 0) + sums.count
            FROM sums WHERE u.%2$I = sums.k
        )
        SELECT coalesce(sum(n), 0) FROM sums
    $step$, target, key_column, count_column, key_type, slots, rejects)
    INTO n USING counter, batch_rows, only_key;
    RETURN n;
END
$function$;
