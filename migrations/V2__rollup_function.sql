-- The rollup: one step, in SQL, shared by the daemon's schedule, `tallyd rollup` and pg_cron.

-- Counters whose rollup adds into a column of the application's own table (the GitHub pattern)
-- instead of tallyd.rollups. Written by tallyd from config.toml at start.
CREATE TABLE tallyd.rollup_targets (
    counter      text     PRIMARY KEY,
    target       regclass NOT NULL,
    key_column   name     NOT NULL,
    count_column name     NOT NULL
);

-- One rollup step. It claims up to batch_rows slot rows with FOR UPDATE SKIP LOCKED (rows a
-- flush or another rollup holds are skipped, never waited on), keeps only the keys whose per-key
-- advisory lock it gets at once (so two workers never fold the same key and never queue on its
-- summary row), deletes those rows and adds their sums, mins and maxes to tallyd.rollups, all
-- in one transaction: a reader of tallyd.totals sees the same total before, during and after.
-- Counters listed in tallyd.rollup_targets fold into their target column instead, and only for
-- keys that have a row there (locked, so it cannot vanish mid-step); other keys stay in slots.
-- Returns the number of slot rows folded.
CREATE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
    n bigint;
    t record;
BEGIN
    WITH claimed AS (
        SELECT s.counter, s.key, s.slot FROM tallyd.slots s
        WHERE NOT EXISTS (SELECT 1 FROM tallyd.rollup_targets r WHERE r.counter = s.counter)
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), owned AS (
        -- Once per claimed row: a transaction that holds a key's lock gets it again at once,
        -- so all claimed rows of a key are kept or skipped together.
        SELECT counter, key, slot FROM claimed
        WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
    ), removed AS (
        DELETE FROM tallyd.slots s
        USING owned o
        WHERE s.counter = o.counter AND s.key = o.key AND s.slot = o.slot
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
    SELECT coalesce(sum(sums.n), 0) INTO folded FROM sums;

    FOR t IN
        SELECT r.counter, r.target, r.key_column, r.count_column,
               format_type(a.atttypid, a.atttypmod) AS key_type
        FROM tallyd.rollup_targets r
        JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
        WHERE EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = r.counter)
    LOOP
        EXECUTE format($step$
            WITH claimed AS (
                SELECT s.key, s.slot FROM tallyd.slots s
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
                DELETE FROM tallyd.slots s USING folding f
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
        $step$, t.target, t.key_column, t.count_column, t.key_type)
        INTO n USING t.counter, batch_rows;
        folded := folded + n;
    END LOOP;
    RETURN folded;
END
$$;

-- Slot rows of rollup_into counters whose key has no row in the target table: they stay in
-- tallyd.slots (never lost) until such a row appears. The daemon reports them as a metric.
CREATE FUNCTION tallyd.unmatched() RETURNS TABLE (counter text, slot_rows bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT r.counter, r.target, r.key_column, format_type(a.atttypid, a.atttypmod) AS key_type
        FROM tallyd.rollup_targets r
        JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
    LOOP
        RETURN QUERY EXECUTE format($q$
            SELECT $1, count(*) FROM tallyd.slots s
            WHERE s.counter = $1
              AND NOT EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%3$s)
        $q$, t.target, t.key_column, t.key_type) USING t.counter;
    END LOOP;
END
$$;
