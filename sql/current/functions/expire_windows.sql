-- tallyd.expire_windows: last changed by migrations/V10__time_windows.sql (changed in V10)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Retention: deletes up to batch_rows rows of `counter`'s `span` windows that start before
-- `before`, from tallyd.slots and tallyd.rollups; returns how many. Rows a flush holds are skipped
-- (SKIP LOCKED) and left to the next call, so it never waits on a flush.
CREATE OR REPLACE FUNCTION tallyd.expire_windows(counter text, span text, before timestamp with time zone, batch_rows integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    n bigint;
    m bigint;
BEGIN
    WITH doomed AS (
        SELECT s.counter, s.key, s.span, s.win, s.slot FROM tallyd.slots s
        WHERE s.counter = expire_windows.counter AND s.span = expire_windows.span
          AND s.win < before
        LIMIT batch_rows
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM tallyd.slots s USING doomed d
    WHERE (s.counter, s.key, s.span, s.win, s.slot) = (d.counter, d.key, d.span, d.win, d.slot);
    GET DIAGNOSTICS n = ROW_COUNT;
    WITH doomed AS (
        SELECT r.counter, r.key, r.span, r.win FROM tallyd.rollups r
        WHERE r.counter = expire_windows.counter AND r.span = expire_windows.span
          AND r.win < before
        LIMIT batch_rows
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM tallyd.rollups r USING doomed d
    WHERE (r.counter, r.key, r.span, r.win) = (d.counter, d.key, d.span, d.win);
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END
$function$;
