-- tallyd.record_flush: last changed by migrations/V21__unique_coverage.sql (changed in V9, V21)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The ledger write of every flush (tallyd.flushes): records flight `flight` of writer `worker`
-- only above what is recorded already, and raises SQLSTATE TD002 (so the whole transaction rolls
-- back) when the writer's row already holds it or a later one. A flush sends its whole
-- transaction at once (pipelined), so once tallyd has given up on a connection the server may
-- still commit it while tallyd, having read the ledger on a new connection, writes the same flight
-- again: that second copy fails here, and the next attempt reads the ledger and takes the flight
-- as committed. Writes only where `tallyd.flushing` is on (set by the flush's BEGIN); checks the
-- lease (tallyd.check_lease) first. `unique_covered` (V21): how far the writer's unique counters'
-- lines are committed, below `covered` while it holds their rows back (the hll extension gone);
-- never lowered.
CREATE OR REPLACE FUNCTION tallyd.record_flush(id text, holder text, worker integer, flight bigint, covered bigint, unique_covered bigint DEFAULT NULL::bigint)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    -- Only inside a flush's transaction (flush.rs, BEGIN): outside one, nothing is written.
    IF current_setting('tallyd.flushing', true) IS DISTINCT FROM 'on' THEN
        RETURN false;
    END IF;
    PERFORM tallyd.check_lease(id, holder);
    INSERT INTO tallyd.flushes AS f (instance_id, owner, writer, seq, journal_covered,
                                     unique_covered, committed_at)
    VALUES (id, holder, worker, flight, covered, coalesce(unique_covered, covered), now())
    ON CONFLICT (instance_id, owner, writer) DO UPDATE SET
        seq = EXCLUDED.seq,
        journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered),
        unique_covered = GREATEST(coalesce(f.unique_covered, f.journal_covered),
                                  EXCLUDED.unique_covered),
        committed_at = EXCLUDED.committed_at
    WHERE f.seq < EXCLUDED.seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flight % of tallyd writer % (instance %) is already recorded: a transaction of a connection tallyd had given up on committed it; this copy rolls back',
            flight, worker, id
            USING ERRCODE = 'TD002';
    END IF;
    RETURN true;
END
$function$;
