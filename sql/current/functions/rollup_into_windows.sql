-- tallyd.rollup_into_windows: last changed by migrations/V11__windowed_rollup_into.sql (changed in V11)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The windowed part of one rollup step for one target (an element of tallyd.rollup_shard's
-- `targets`): keys held by a foreign key (tallyd.rollup_held) whose retry is due, each on its
-- own, then one batch (tallyd.rollup_into_window); if the batch raises (a key's column would leave
-- its type's range, or an insert's parent row is missing), key by key instead, each in its own
-- subtransaction, holding back only the keys that fail: a range error in tallyd.rollup_rejects
-- (retried after a minute, as for all-time targets), a foreign key in tallyd.rollup_held. The keys
-- are those the batch could claim (without insert_missing, only keys with a window whose row
-- exists: others would never fold and must not fill the window), those with a row to insert
-- first (only an insert can fail on a foreign key, and the key that does, typically the newest
-- id, must not wait behind every key that only updates), then in key order, so that successive
-- steps page through them as their rows fold away. Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_into_windows(target jsonb, batch_rows integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    counter_name text := target ->> 'counter';
    window_type text := target ->> 'window_type';
    zone text := target ->> 'time_zone';
    n bigint := 0;
    k record;
BEGIN
    FOR k IN
        SELECT h.key FROM tallyd.rollup_held h
        WHERE h.counter = counter_name AND h.retry_at <= now()
        ORDER BY h.retry_at, h.key
        LIMIT batch_rows
    LOOP
        BEGIN
            n := n + tallyd.rollup_into_window(target, batch_rows, k.key);
            DELETE FROM tallyd.rollup_held h WHERE h.counter = counter_name AND h.key = k.key;
        EXCEPTION
            WHEN foreign_key_violation THEN
                UPDATE tallyd.rollup_held h SET
                    cause = SQLERRM,
                    attempts = h.attempts + 1,
                    retry_at = now() + least(interval '60 seconds',
                                             interval '1 second' * 2 ^ least(h.attempts, 6))
                WHERE h.counter = counter_name AND h.key = k.key;
            WHEN numeric_value_out_of_range THEN
                DELETE FROM tallyd.rollup_held h WHERE h.counter = counter_name AND h.key = k.key;
                INSERT INTO tallyd.rollup_rejects AS j (counter, key, total) VALUES (counter_name, k.key, NULL)
                ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now();
        END;
    END LOOP;

    BEGIN
        n := n + tallyd.rollup_into_window(target, batch_rows, NULL);
    EXCEPTION WHEN numeric_value_out_of_range OR foreign_key_violation THEN
        FOR k IN EXECUTE format($keys$
            SELECT s.key FROM tallyd.slots s
            WHERE s.counter = $1 AND s.span = $3
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h
                              WHERE h.counter = s.counter AND h.key = s.key)
            GROUP BY s.key
            HAVING $4 OR bool_or(EXISTS (SELECT 1 FROM %1$s u
                                         WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s))
            -- Keys with a (key, window) row to insert first: only an insert can fail on a
            -- foreign key, and the key that does (a version just published: the highest id)
            -- must not wait behind every key that only updates.
            ORDER BY bool_and(EXISTS (SELECT 1 FROM %1$s u
                                      WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s)), s.key
            LIMIT $2
        $keys$, (target ->> 'target')::regclass, target ->> 'key_column', target ->> 'key_type',
             target ->> 'window_column', tallyd.window_value('s', window_type, zone))
        USING counter_name, batch_rows, target ->> 'span', (target ->> 'insert_missing')::boolean
        LOOP
            BEGIN
                n := n + tallyd.rollup_into_window(target, batch_rows, k.key);
            EXCEPTION
                WHEN foreign_key_violation THEN
                    INSERT INTO tallyd.rollup_held AS h (counter, key, cause)
                    VALUES (counter_name, k.key, SQLERRM)
                    ON CONFLICT (counter, key) DO UPDATE SET cause = EXCLUDED.cause;
                WHEN numeric_value_out_of_range THEN
                    INSERT INTO tallyd.rollup_rejects AS j (counter, key, total)
                    VALUES (counter_name, k.key, NULL)
                    ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now();
            END;
        END LOOP;
    END;
    RETURN n;
END
$function$;
