-- tallyd.forget: last changed by migrations/V12__counter_kinds.sql (changed in V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Corrections from SQL, inside the application's own transaction: exact with respect to commits
-- (increments committed before this transaction commits are superseded, later ones are added; what
-- a tallyd holds in memory commits later, so it is added), as a second tallyd instance's correction
-- is. `key` in the counter's canonical form (docs/protocol.md, "Keys"). Both take tallyd.slots in
-- SHARE ROW EXCLUSIVE mode, as tallyd.correct does.
-- - forget(counter, key): forgets `key` in `counter`, every row in every window and slot, with
--   what the rollup held back of it. Returns the rows deleted.
-- - forget(key): forgets `key` in every counter that has rows of it, in counter name order.
--   Returns the rows deleted.
CREATE OR REPLACE FUNCTION tallyd.forget(counter text, key text)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    n bigint;
    m bigint;
BEGIN
    -- As tallyd.correct: writers of tallyd.slots wait for this transaction.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(1952541816, hashtext(forget.counter || E'\n' || forget.key));
    DELETE FROM tallyd.slots s WHERE s.counter = forget.counter AND s.key = forget.key;
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM tallyd.rollups r WHERE r.counter = forget.counter AND r.key = forget.key;
    GET DIAGNOSTICS m = ROW_COUNT;
    DELETE FROM tallyd.rollup_rejects j WHERE j.counter = forget.counter AND j.key = forget.key;
    DELETE FROM tallyd.rollup_held h WHERE h.counter = forget.counter AND h.key = forget.key;
    RETURN n + m;
END
$function$;

CREATE OR REPLACE FUNCTION tallyd.forget(key text)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    c text;
    n bigint := 0;
BEGIN
    FOR c IN SELECT DISTINCT counter FROM tallyd.slots s WHERE s.key = forget.key
             UNION SELECT DISTINCT counter FROM tallyd.rollups r WHERE r.key = forget.key
             ORDER BY 1
    LOOP
        n := n + tallyd.forget(c, forget.key);
    END LOOP;
    RETURN n;
END
$function$;
