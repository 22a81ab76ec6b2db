-- tallyd.correct: last changed by migrations/V20__set_rollup_into.sql (changed in V12, V15, V20)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Corrections (docs/design.md, "Corrections"), in a flush's transaction before the flight's
-- upserts (called by the flush; writes only where `tallyd.flushing` is on, as the upserts). First
-- the SHARE ROW EXCLUSIVE lock on tallyd.slots: until this transaction commits no other writes
-- slots (flushes of every instance, rollup steps), so what committed before the correction is what
-- its DELETEs see (new slot rows too, which no row lock would hold back), and what commits after it
-- adds to its total. Then for each corrected key in order, the key's advisory lock (the one every
-- rollup step tries, so no step folds the key meanwhile), and its stored rows deleted, in every slot
-- (other instances' too) and in tallyd.rollups: a set's window (span, win in Unix ms), or a
-- forget's every row, with what the rollup held back of the key. The flight's upsert then writes
-- the key's new total. A set of a windowed sum also moves the rows written beside the window (its
-- coarser windows, its all-time row: `beside_of` names the correction, from 1) by the window's
-- difference: the set's value, less the window's stored total just deleted, less what the set
-- superseded in memory (`superseded`: those events are in the flight's beside rows), written to
-- this writer's slot (`slots`). A set that would take a beside row (this writer's slot row, or the
-- row's total over every slot and the summary) beyond the signed 64-bit range raises SQLSTATE TD003
-- with the correction's position (from 1) as its DETAIL, and the flush refuses that correction and
-- writes the flight again without it (the raise fails the whole transaction: nothing of it is
-- written). A set of a rollup_into counter's target window (`into_target`, V20) is written into
-- the application's row by tallyd.set_target (the flight then writes only the events after it), and
-- what that row held is part of the window's stored total.
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
