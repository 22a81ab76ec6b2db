-- tallyd.correct (V12) with a range guard (issue 33): a windowed sum's set moves the rows beside
-- its window (its coarser windows, its all-time row) by the window's difference, and that move
-- could take one of them beyond the signed 64-bit range. V12 then failed with `bigint out of
-- range` (SQLSTATE 22003) at every retry: the flight never committed, its worker's other keys
-- waited behind it, and the next start replayed the correction into the same failure. Now the
-- difference and every row it moves (the writer's slot row and the row's total over every slot
-- and the summary) are checked before anything is deleted, and a set that would leave the range
-- raises SQLSTATE TD003 naming the correction (its position, from 1, in the DETAIL): the flush
-- refuses that correction (answered `error overflow`), keeps the events it superseded, and writes
-- the flight again without it. And the move adds the difference to the writer's slot row as
-- numeric: V12 inserted the difference itself, which fails for a difference beyond bigint even
-- where the row's new count is not (a window at -5 set to the maximum moves its all-time row at -5
-- by the maximum + 5, to the maximum).
CREATE OR REPLACE FUNCTION tallyd.correct(
    counters text[], keys text[], spans text[], wins bigint[], forgets boolean[],
    set_values bigint[], superseded bigint[], slots int[],
    beside_of int[], beside_spans text[], beside_wins bigint[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    w timestamptz;
    beside_win timestamptz;
    stored numeric;
    gone numeric;
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
        -- Read before anything is deleted: a set refused below must change nothing.
        SELECT coalesce(sum(count), 0) INTO stored FROM tallyd.slots
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        SELECT coalesce(sum(count), 0) INTO gone FROM tallyd.rollups
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        delta := set_values[i] - stored - gone - superseded[i];
        IF delta IS NOT NULL AND delta <> 0 THEN
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
        END IF;
        DELETE FROM tallyd.slots
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        DELETE FROM tallyd.rollups
        WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w;
        CONTINUE WHEN delta IS NULL OR delta = 0;
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
$$;
