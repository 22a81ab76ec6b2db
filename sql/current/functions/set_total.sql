-- tallyd.set_total: last changed by migrations/V20__set_rollup_into.sql (changed in V12, V20)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Sets `key`'s all-time total in `counter` to `total`, from SQL inside the application's own
-- transaction (exact with respect to commits, as tallyd.forget): its rows deleted, one rollup row
-- of `total` written. Refused for a counter with windowed rows (their totals would disagree) or
-- rows of another kind than sum. For an all-time sum folded into an application's table (V20) the
-- key's slot rows are deleted and its row's column set to `total` (tallyd.set_target); a windowed
-- (or max, min) rollup_into counter is refused: `tallyd set --window` knows its `also` rows. A counter
-- with no rows at all is taken for an all-time sum: if the config declares it another kind,
-- tallyd's next start refuses it (src/store/kinds.rs).
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
