-- tallyd.set_target: last changed by migrations/V20__set_rollup_into.sql (changed in V20)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- A set of one (key, window) row of a rollup_into counter's target to `total` (tallyd.correct's
-- sets of a target window, tallyd.set_total of an all-time target), called after tallyd.slots is
-- locked SHARE ROW EXCLUSIVE and the key's slot rows of that window are deleted, so no flush,
-- direct write or rollup step writes the row meanwhile; the row is locked after that table lock,
-- as the rollup step and the direct writes lock (tallyd.slots, then the target). Returns what the
-- row's column held before (0 for a row it inserts or a total it holds in a slot row), which the
-- caller needs to move the window's `also` rows. Sets the column to the total and the on_add
-- columns to their constants; inserts a missing row where the target has insert_missing. Where
-- the row is missing without insert_missing, its parent is missing (a foreign key), or the counter
-- has no usable target, writes the total as a slot row (`set_slot`) instead, held as that key's events
-- are. A total beyond the column's type raises SQLSTATE TD003 (DETAIL: `correction`). Inside a flush
-- the row lock waits at most 200 ms (raising lock_not_available: the flush tries again after its
-- backoff).
CREATE OR REPLACE FUNCTION tallyd.set_target(set_counter text, set_key text, set_span text, w timestamptz, total bigint, set_slot integer, correction integer)
 RETURNS numeric
 LANGUAGE plpgsql
AS $function$
DECLARE
    t jsonb;
    windowed boolean;
    probe text;
    on_add_set text;
    on_add_columns text;
    on_add_values text;
    utid tid;
    old numeric;
    saved text := current_setting('lock_timeout');
    flushing boolean := current_setting('tallyd.flushing', true) IS NOT DISTINCT FROM 'on';
    inserted bigint;
BEGIN
    SELECT x INTO t FROM jsonb_array_elements(tallyd.rollup_targets_json()) x
    WHERE x ->> 'counter' = set_counter AND coalesce(x ->> 'span', 'all') = set_span
      AND coalesce(x ->> 'kind', 'sum') = 'sum';
    IF t IS NOT NULL AND t ->> 'target' IS NOT NULL THEN
        windowed := coalesce(t ->> 'span', 'all') <> 'all';
        -- The row's key (and window, read from x.win as the rollup step reads a slot row's).
        probe := format('u.%I = $1::%s', t ->> 'key_column', t ->> 'key_type');
        IF windowed THEN
            probe := probe || format(' AND u.%I = %s', t ->> 'window_column',
                                     tallyd.window_value('x', t ->> 'window_type', t ->> 'time_zone'));
        END IF;
        SELECT coalesce(string_agg(format(', %I = %s', e.key, e.value), '' ORDER BY e.key), ''),
               coalesce(string_agg(format(', %I', e.key), '' ORDER BY e.key), ''),
               coalesce(string_agg(', ' || e.value, '' ORDER BY e.key), '')
        INTO on_add_set, on_add_columns, on_add_values
        FROM jsonb_each_text(t -> 'on_add') e;
        IF flushing THEN
            PERFORM set_config('lock_timeout', '200ms', true);
        END IF;
        BEGIN
            LOOP
                EXECUTE format('SELECT u.ctid, coalesce(u.%I, 0)::numeric FROM %s u, (SELECT $2::timestamptz AS win) x
                                WHERE %s LIMIT 1 FOR NO KEY UPDATE OF u',
                               t ->> 'count_column', t ->> 'target', probe)
                INTO utid, old USING set_key, w;
                IF utid IS NOT NULL THEN
                    EXECUTE format('UPDATE %s u SET %I = $1%s WHERE u.ctid = $2',
                                   t ->> 'target', t ->> 'count_column', on_add_set)
                    USING total, utid;
                    PERFORM set_config('lock_timeout', saved, true);
                    RETURN old;
                END IF;
                EXIT WHEN NOT (windowed AND coalesce((t ->> 'insert_missing')::boolean, false));
                -- A row the application inserts meanwhile is found by the conflict: then it is
                -- locked, read and set as above.
                EXECUTE format('INSERT INTO %s AS u (%I, %I, %I%s)
                                SELECT $1::%s, %s, $3%s FROM (SELECT $2::timestamptz AS win) x
                                ON CONFLICT (%I, %I) DO NOTHING',
                               t ->> 'target', t ->> 'key_column', t ->> 'window_column',
                               t ->> 'count_column', on_add_columns, t ->> 'key_type',
                               tallyd.window_value('x', t ->> 'window_type', t ->> 'time_zone'),
                               on_add_values, t ->> 'key_column', t ->> 'window_column')
                USING set_key, w, total;
                GET DIAGNOSTICS inserted = ROW_COUNT;
                IF inserted > 0 THEN
                    PERFORM set_config('lock_timeout', saved, true);
                    RETURN 0;
                END IF;
            END LOOP;
        EXCEPTION
            WHEN numeric_value_out_of_range THEN
                RAISE EXCEPTION 'the set of % % to % is beyond the range of column % of %',
                        set_counter, set_key, total, t ->> 'count_column', t ->> 'target'
                    USING ERRCODE = 'TD003', DETAIL = coalesce(correction::text, '');
            WHEN lock_not_available THEN
                RAISE EXCEPTION 'the set of % % waits for its row in %, which another transaction holds',
                        set_counter, set_key, t ->> 'target'
                    USING ERRCODE = 'lock_not_available';
            WHEN foreign_key_violation THEN
                -- The row's parent is missing: the total is held in tallyd.slots below, as the
                -- rollup holds that key's events.
                NULL;
        END;
        PERFORM set_config('lock_timeout', saved, true);
    END IF;
    INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
    VALUES (set_counter, set_key, set_span, w, set_slot, total, now(), now())
    ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET count = s.count + EXCLUDED.count;
    RETURN 0;
END
$function$;
