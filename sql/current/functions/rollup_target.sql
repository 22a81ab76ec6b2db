-- tallyd.rollup_target: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One step of a counter's rows bound for its rollup_into target, after the key `after_key`: keys
-- held back by a foreign key whose retry is due first, each on its own (V11), then the batch (the
-- target's generated step function); if the batch fails because a key's column would leave its
-- type's range or an inserted row's parent is missing (the step function then writes nothing and
-- returns the batch's keys), those keys one by one, in key order, each in its own subtransaction,
-- holding back only those that fail (tallyd.rollup_rejects,
-- retried after a minute, or tallyd.rollup_held, retried 1 s later, then 2, 4, ... up to 60 s). A
-- target without a step function (its table or a column was missing at the last start) folds
-- nothing. Returns as tallyd.rollup_summary does.
CREATE OR REPLACE FUNCTION tallyd.rollup_target(counter_name text, after_key text, batch_rows integer, OUT folded bigint, OUT claimed bigint, OUT last_key text)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
DECLARE
    step text := 'tallyd.' || quote_ident('rollup_into_step_' || md5(counter_name));
    t record;
    n bigint;
    failed text[];
    k record;
BEGIN
    -- The lock every writer of tallyd.slots holds, taken before any row is claimed: a claimed
    -- row's DELETE needs it, and a correction (tallyd.correct's SHARE ROW EXCLUSIVE, held while
    -- it waits for a row this step claimed) would otherwise deadlock with it.
    LOCK TABLE tallyd.slots IN ROW EXCLUSIVE MODE;
    folded := 0;
    claimed := 0;
    SELECT r.span, r.insert_missing INTO t FROM tallyd.rollup_targets r WHERE r.counter = counter_name;
    IF NOT FOUND OR to_regprocedure(step || '(text,integer,text)') IS NULL THEN
        RETURN;
    END IF;
    IF after_key = '' THEN
        -- A new pass: keys whose column would have left its type's range are tried again.
        DELETE FROM tallyd.rollup_rejects j
        WHERE j.counter = counter_name AND j.total IS NULL AND j.rejected_at < now() - interval '1 minute';
    END IF;
    IF t.insert_missing THEN
        FOR k IN
            SELECT h.key FROM tallyd.rollup_held h
            WHERE h.counter = counter_name AND h.retry_at <= now()
            ORDER BY h.retry_at, h.key
            LIMIT batch_rows
        LOOP
            BEGIN
                EXECUTE format('SELECT x.folded FROM %s($1, $2, $3) x', step)
                    INTO n USING '', batch_rows, k.key;
                folded := folded + n;
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
    END IF;
    EXECUTE format('SELECT x.folded, x.claimed, x.last_key, x.failed_keys FROM %s($1, $2, NULL) x', step)
        INTO n, claimed, last_key, failed USING after_key, batch_rows;
    folded := folded + n;
    -- The batch failed (a key's column would leave its type's range, or an inserted row's
    -- parent is missing): its keys one by one, each in its own subtransaction, holding back only
    -- those that fail.
    FOR k IN SELECT x AS key FROM unnest(failed) AS x LOOP
        BEGIN
            EXECUTE format('SELECT x.folded FROM %s($1, $2, $3) x', step)
                INTO n USING '', batch_rows, k.key;
            folded := folded + n;
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
END
$function$;
