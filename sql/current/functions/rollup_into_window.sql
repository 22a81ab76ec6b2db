-- tallyd.rollup_into_window: last changed by migrations/V11__windowed_rollup_into.sql (changed in V11)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The fold of one windowed target, in one statement, optionally for one key only: up to
-- batch_rows slot rows of its window span, claimed with FOR UPDATE SKIP LOCKED, kept only for
-- keys whose per-key advisory lock is free (as every rollup step), deleted, and their sums added
-- to the target's (key, window) rows. Rows of the target the application holds are skipped (SKIP
-- LOCKED) and left to a later step. Without insert_missing only existing (key, window) rows are
-- claimed; with it, missing ones are inserted (INSERT ... ON CONFLICT (key_column,
-- window_column)). Keys in tallyd.rollup_rejects, and held keys unless `only_key` names one, are
-- left alone. Raises numeric_value_out_of_range (the column's type) and foreign_key_violation (an
-- insert's parent row is missing); the caller (tallyd.rollup_into_windows) then goes key by key.
-- Plain PostgreSQL only: tallyd refuses a windowed rollup_into on Citus (src/store/citus.rs).
-- Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_into_window(target jsonb, batch_rows integer, only_key text)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    insert_missing boolean := (target ->> 'insert_missing')::boolean;
    window_type text := target ->> 'window_type';
    zone text := target ->> 'time_zone';
    -- %1$s the target table, %2$I its key column, %3$I its window column, %4$I its count
    -- column, %5$s the key column's type; %6$s, %7$s and %8$s the window column's value of the
    -- slot rows aliased s, o and r.
    args text[] := ARRAY[(target ->> 'target')::regclass::text, target ->> 'key_column',
                         target ->> 'window_column', target ->> 'count_column',
                         target ->> 'key_type', tallyd.window_value('s', window_type, zone),
                         tallyd.window_value('o', window_type, zone),
                         tallyd.window_value('r', window_type, zone)];
    -- Without insert_missing: only slot rows whose (key, window) row exists are claimed (others
    -- would fill the batch and never fold), and the fold updates those rows.
    claim text := CASE WHEN insert_missing THEN 'true' ELSE
        'EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%5$s AND u.%3$I = %6$s)' END;
    missing text := CASE WHEN insert_missing THEN
        'OR NOT EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = o.key::%5$s AND u.%3$I = %7$s)'
        ELSE '' END;
    write text := CASE WHEN insert_missing THEN $w$
            INSERT INTO %1$s AS u (%2$I, %3$I, %4$I)
            SELECT k, w, count FROM sums
            ON CONFLICT (%2$I, %3$I) DO UPDATE SET %4$I = coalesce(u.%4$I, 0) + EXCLUDED.%4$I
        $w$ ELSE $w$
            UPDATE %1$s u SET %4$I = coalesce(u.%4$I, 0) + sums.count
            FROM sums WHERE u.%2$I = sums.k AND u.%3$I = sums.w
        $w$ END;
    step text := $step$
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.key, s.win, s.slot FROM tallyd.slots s
            WHERE s.counter = $1 AND s.span = $4
              AND ($3::text IS NULL OR s.key = $3)
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
              AND ($3::text IS NOT NULL OR NOT EXISTS (
                       SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key))
              AND %9$s
            LIMIT $2
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT key, win, slot FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext($1 || E'\n' || key))
        ), existing AS (
            SELECT u.%2$I AS k, u.%3$I AS w FROM %1$s u
            WHERE (u.%2$I, u.%3$I) IN (SELECT o.key::%5$s, %7$s FROM owned o)
            FOR NO KEY UPDATE OF u SKIP LOCKED
        ), folding AS (
            -- Rows whose target row this step holds, and with insert_missing those with none
            -- yet (a row another transaction holds exists, so it is skipped, never waited on).
            SELECT o.key, o.win, o.slot FROM owned o
            WHERE (o.key::%5$s, %7$s) IN (SELECT k, w FROM existing) %10$s
        ), removed AS (
            DELETE FROM tallyd.slots s USING folding f
            WHERE s.counter = $1 AND s.key = f.key AND s.span = $4 AND s.win = f.win
              AND s.slot = f.slot
            RETURNING s.key, s.win, s.count
        ), sums AS (
            -- Grouped by the target's values: keys that cast alike share a row.
            SELECT r.key::%5$s AS k, %8$s AS w, sum(r.count)::bigint AS count, count(*) AS n
            FROM removed r GROUP BY 1, 2
        ), written AS (%11$s)
        SELECT coalesce(sum(n), 0) FROM sums
    $step$;
    n bigint;
BEGIN
    EXECUTE format(step, VARIADIC args || ARRAY[format(claim, VARIADIC args),
                                                format(missing, VARIADIC args),
                                                format(write, VARIADIC args)])
    INTO n
    USING target ->> 'counter', batch_rows, only_key, target ->> 'span';
    RETURN n;
END
$function$;
