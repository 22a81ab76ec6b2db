-- tallyd.unmatched: last changed by migrations/V14__set_based_rollup.sql (changed in V2, V11, V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Slot rows of rollup_into counters that wait for a row of the target table, per counter (the
-- daemon reports them as a metric): for an all-time target, keys without a row; for a windowed one
-- without insert_missing, rows whose (key, window) has none. A windowed target with insert_missing
-- inserts what is missing: 0 (its keys held by a foreign key are reported by tallyd.held_back()).
-- Each probe is a LATERAL ... LIMIT 1 under enable_seqscan off (V14): one index probe per slot row
-- whatever the statistics say (V11's NOT EXISTS could hash the whole target table).
CREATE OR REPLACE FUNCTION tallyd.unmatched()
 RETURNS TABLE(counter text, slot_rows bigint)
 LANGUAGE plpgsql
 STABLE
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT x.counter, x.target::regclass AS target, x.key_column, x.key_type, x.span,
               x.window_column, x.window_type, x.time_zone, x.insert_missing
        FROM jsonb_to_recordset(tallyd.rollup_targets_json())
             AS x (counter text, target text, key_column name, key_type text, span text,
                   window_column name, window_type text, time_zone text, insert_missing boolean)
        WHERE x.target IS NOT NULL
    LOOP
        IF t.span = 'all' THEN
            RETURN QUERY EXECUTE format($q$
                SELECT $1, count(*) FROM tallyd.slots s
                LEFT JOIN LATERAL (SELECT 1 AS found FROM %1$s u WHERE u.%2$I = s.key::%3$s LIMIT 1) u ON true
                WHERE s.counter = $1 AND u.found IS NULL
            $q$, t.target, t.key_column, t.key_type) USING t.counter;
        ELSIF t.insert_missing THEN
            RETURN QUERY SELECT t.counter, 0::bigint;
        ELSE
            RETURN QUERY EXECUTE format($q$
                SELECT $1, count(*) FROM tallyd.slots s
                LEFT JOIN LATERAL (SELECT 1 AS found FROM %1$s u
                                   WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s LIMIT 1) u ON true
                WHERE s.counter = $1 AND s.span = $2 AND u.found IS NULL
            $q$, t.target, t.key_column, t.key_type, t.window_column,
                 tallyd.window_value('s', t.window_type, t.time_zone))
                USING t.counter, t.span;
        END IF;
    END LOOP;
END
$function$;
