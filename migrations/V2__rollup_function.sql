-- One rollup step, shared by the daemon's schedule, `tallyd rollup` and pg_cron.
--
-- It claims up to batch_rows slot rows with FOR UPDATE SKIP LOCKED (rows a flush or another
-- rollup holds are skipped, never waited on), keeps only the keys whose per-key advisory lock it
-- gets at once (so two workers never fold the same key and never queue on its summary row),
-- deletes those rows and adds their sums, mins and maxes to tallyd.rollups, all in one
-- transaction: a reader of tallyd.totals sees the same total before, during and after.
-- Returns the number of slot rows folded.
CREATE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
BEGIN
    WITH claimed AS (
        SELECT counter, key, slot FROM tallyd.slots
        LIMIT batch_rows
        FOR UPDATE SKIP LOCKED
    ), owned AS (
        -- Volatile, so PostgreSQL evaluates it once per distinct key of the materialised claim.
        SELECT counter, key FROM (SELECT DISTINCT counter, key FROM claimed) k
        WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
    ), removed AS (
        DELETE FROM tallyd.slots s
        USING claimed c JOIN owned o USING (counter, key)
        WHERE s.counter = c.counter AND s.key = c.key AND s.slot = c.slot
        RETURNING s.counter, s.key, s.count, s.first_seen, s.last_seen
    ), sums AS (
        SELECT counter, key, sum(count)::bigint AS count,
               min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n
        FROM removed GROUP BY counter, key
    ), added AS (
        INSERT INTO tallyd.rollups AS r (counter, key, count, first_seen, last_seen)
        SELECT counter, key, count, first_seen, last_seen FROM sums
        ON CONFLICT (counter, key) DO UPDATE SET
            count = r.count + EXCLUDED.count,
            first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
            last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)
    )
    SELECT coalesce(sum(n), 0) INTO folded FROM sums;
    RETURN folded;
END
$$;
