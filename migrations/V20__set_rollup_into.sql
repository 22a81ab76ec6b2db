-- Corrections on rollup_into counters (issue 35): `!set`, `tallyd set` and tallyd.set_total set the
-- total where it lives, the application's column. Until now they were refused for these counters,
-- and a recount (the most common repair of such a column) meant stopping traffic or racing the
-- flushes.
--
-- tallyd.set_target sets one (key, window) row of a counter's target to a total: it runs after
-- tallyd.slots is locked (SHARE ROW EXCLUSIVE, by tallyd.correct or tallyd.set_total) and the key's
-- slot rows of that window are deleted, so no flush, direct write or rollup step of any instance
-- writes the row meanwhile, and it takes the row's lock after that table lock, as the rollup step
-- and the direct writes do (tallyd.slots first, then the target), never the other way round. The
-- row is locked and read (its column before the set, which the caller needs to move the window's
-- `also` rows), then its column set to the total and its on_add columns to their constants. A
-- missing row is inserted with the total where the target has insert_missing; where it has not,
-- where the insert finds the row's parent missing (a foreign key), or where the counter has no
-- usable target recorded, the total is written as a slot row of the key instead (slot `set_slot`),
-- held as any event of that key is until the rollup can fold it. A total beyond the column's type
-- raises SQLSTATE TD003 (DETAIL: the correction's position), so the flush refuses that set. Inside
-- a flush the row lock waits at most 200 ms (as a direct write: the flush holds every writer of
-- tallyd.slots back meanwhile); a row the application holds longer fails the flight with
-- lock_not_available, and the flush writes it again after its backoff, set included.
--
-- tallyd.correct takes a new argument, `into_target`: which sets are of a rollup_into counter's
-- target window (the flight then writes only the events after the set for that row, since the
-- column already holds the set's value). tallyd.set_total accepts an all-time rollup_into counter.

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

DROP FUNCTION tallyd.correct(text[], text[], text[], bigint[], boolean[], bigint[], bigint[], integer[], integer[], text[], bigint[]);

CREATE OR REPLACE FUNCTION tallyd.correct(counters text[], keys text[], spans text[], wins bigint[], forgets boolean[], set_values bigint[], superseded bigint[], slots integer[], beside_of integer[], beside_spans text[], beside_wins bigint[], into_target boolean[])
 RETURNS void
 LANGUAGE plpgsql
AS $function$
DECLARE
    w timestamptz;
    beside_win timestamptz;
    stored numeric;
    gone numeric;
    held numeric;
    delta numeric;
    row_total numeric;
    slot_count numeric;
BEGIN
    IF current_setting('tallyd.flushing', true) IS DISTINCT FROM 'on'
       OR coalesce(array_length(keys, 1), 0) = 0 THEN
        RETURN;
    END IF;
    -- Until this transaction commits, no other writes tallyd.slots (flushes of every instance,
    -- rollup steps): it waits for those in progress, so that what committed before the
    -- correction commits is what its DELETEs see (new slot rows too, which no row lock would
    -- hold back), and what commits after it is added to its total. Corrections are rare; the
    -- flushes they hold back wait for one flight.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        PERFORM pg_advisory_xact_lock(1952541816, hashtext(counters[i] || E'\n' || keys[i]));
        IF forgets[i] THEN
            DELETE FROM tallyd.slots WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollups WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollup_rejects WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollup_held WHERE counter = counters[i] AND key = keys[i];
            CONTINUE;
        END IF;
        w := CASE WHEN wins[i] = -9223372036854775808 THEN '-infinity'::timestamptz
                  ELSE 'epoch'::timestamptz + wins[i] * interval '1 millisecond' END;
        SELECT coalesce(sum(count), 0) INTO stored FROM tallyd.slots
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        SELECT coalesce(sum(count), 0) INTO gone FROM tallyd.rollups
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        DELETE FROM tallyd.slots
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        DELETE FROM tallyd.rollups
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        -- A rollup_into counter's target window: the application's row takes the value (or a
        -- slot row holds it), and what the row held is part of the window's stored total. A
        -- refusal below (TD003) fails the whole transaction: nothing of it is written.
        held := 0;
        IF into_target[i] AND set_values[i] IS NOT NULL THEN
            held := tallyd.set_target(counters[i], keys[i], spans[i], w, set_values[i], slots[i], i);
        END IF;
        delta := set_values[i] - stored - gone - held - superseded[i];
        CONTINUE WHEN delta IS NULL OR delta = 0;
        FOR j IN 1 .. coalesce(array_length(beside_of, 1), 0) LOOP
            CONTINUE WHEN beside_of[j] <> i;
            beside_win := CASE WHEN beside_wins[j] = -9223372036854775808 THEN '-infinity'::timestamptz
                               ELSE 'epoch'::timestamptz + beside_wins[j] * interval '1 millisecond' END;
            SELECT coalesce(sum(count), 0), coalesce(sum(count) FILTER (WHERE slot = slots[i]), 0)
            INTO row_total, slot_count FROM tallyd.slots AS t
            WHERE counter = counters[i] AND key = keys[i] AND span = beside_spans[j] AND win = beside_win;
            row_total := row_total + (SELECT coalesce(sum(count), 0) FROM tallyd.rollups
                WHERE counter = counters[i] AND key = keys[i] AND span = beside_spans[j] AND win = beside_win);
            IF slot_count + delta NOT BETWEEN -9223372036854775808 AND 9223372036854775807
               OR row_total + delta NOT BETWEEN -9223372036854775808 AND 9223372036854775807 THEN
                RAISE EXCEPTION 'the set of % % would move its % row by % to %, beyond the signed 64-bit range',
                        counters[i], keys[i], beside_spans[j], delta, row_total + delta
                    USING ERRCODE = 'TD003', DETAIL = i::text;
            END IF;
        END LOOP;
        FOR j IN 1 .. coalesce(array_length(beside_of, 1), 0) LOOP
            CONTINUE WHEN beside_of[j] <> i;
            -- Computed here, not in the INSERT: Citus evaluates an INSERT's expressions on the
            -- coordinator arm by arm, so the ELSE arm of an all-time row's CASE would fail
            -- ("interval out of range") and the flush with it, at every retry.
            beside_win := CASE WHEN beside_wins[j] = -9223372036854775808 THEN '-infinity'::timestamptz
                               ELSE 'epoch'::timestamptz + beside_wins[j] * interval '1 millisecond' END;
            -- The row's count and the difference added as numeric: the difference alone may be
            -- beyond bigint where their sum is not (a window at -5 set to the maximum).
            UPDATE tallyd.slots AS t SET count = t.count + delta
            WHERE counter = counters[i] AND key = keys[i] AND span = beside_spans[j]
              AND win = beside_win AND slot = slots[i];
            CONTINUE WHEN FOUND;
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            VALUES (counters[i], keys[i], beside_spans[j], beside_win, slots[i], delta, now(), now())
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET count = s.count + EXCLUDED.count;
        END LOOP;
    END LOOP;
END
$function$;

CREATE OR REPLACE FUNCTION tallyd.set_total(counter text, key text, total bigint)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
BEGIN
    -- As tallyd.correct: writers of tallyd.slots wait for this transaction.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(1952541816, hashtext(set_total.counter || E'\n' || set_total.key));
    IF EXISTS (SELECT 1 FROM tallyd.rollup_targets t WHERE t.counter = set_total.counter) THEN
        IF EXISTS (SELECT 1 FROM tallyd.rollup_targets t WHERE t.counter = set_total.counter
                   AND (t.span <> 'all' OR t.kind <> 'sum')) THEN
            RAISE EXCEPTION 'tallyd.set_total: counter % folds a window (or another kind than sum) into an application''s table: set it with `tallyd set --window`', set_total.counter;
        END IF;
        DELETE FROM tallyd.slots s
        WHERE s.counter = set_total.counter AND s.key = set_total.key AND s.span = 'all';
        PERFORM tallyd.set_target(set_total.counter, set_total.key, 'all', '-infinity', total, 0, NULL);
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = set_total.counter
                  AND (s.span <> 'all' OR s.kind IS NOT NULL))
       OR EXISTS (SELECT 1 FROM tallyd.rollups r WHERE r.counter = set_total.counter
                  AND (r.span <> 'all' OR r.kind IS NOT NULL)) THEN
        RAISE EXCEPTION 'tallyd.set_total: counter % is not an all-time sum (it has windowed rows or rows of another kind)', set_total.counter;
    END IF;
    DELETE FROM tallyd.slots s WHERE s.counter = set_total.counter AND s.key = set_total.key;
    DELETE FROM tallyd.rollups r WHERE r.counter = set_total.counter AND r.key = set_total.key;
    DELETE FROM tallyd.rollup_rejects j WHERE j.counter = set_total.counter AND j.key = set_total.key;
    INSERT INTO tallyd.rollups (counter, key, count, first_seen, last_seen)
    VALUES (set_total.counter, set_total.key, total, now(), now());
END
$function$;
