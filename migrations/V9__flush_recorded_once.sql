-- The flush ledger records each flight once, on the server. A flush sends its whole transaction
-- at once (BEGIN to COMMIT, pipelined), so once tallyd has given up on a connection (a half-open
-- TCP connection, a client-side timeout) the server may still run that transaction to its
-- COMMIT while tallyd, having read the ledger on a new connection, writes the same flight again.
-- The second one's upserts wait for the first's row locks and would add the counts again; its
-- ledger row is where it must fail. `tallyd.record_flush` is the ledger write of every flush:
-- it records `seq` for the writer only above what is recorded already, and raises (SQLSTATE
-- TD002, so the whole transaction rolls back) when the writer's row already holds `seq` or a
-- later one. The next attempt then reads the ledger and takes the flight as committed.
CREATE FUNCTION tallyd.record_flush(id text, holder text, worker int, flight bigint,
                                    covered bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only inside a flush's transaction (flush.rs, BEGIN): outside one, nothing is written.
    IF current_setting('tallyd.flushing', true) IS DISTINCT FROM 'on' THEN
        RETURN false;
    END IF;
    PERFORM tallyd.check_lease(id, holder);
    INSERT INTO tallyd.flushes AS f (instance_id, owner, writer, seq, journal_covered, committed_at)
    VALUES (id, holder, worker, flight, covered, now())
    ON CONFLICT (instance_id, owner, writer) DO UPDATE SET
        seq = EXCLUDED.seq,
        journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered),
        committed_at = EXCLUDED.committed_at
    WHERE f.seq < EXCLUDED.seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flight % of tallyd writer % (instance %) is already recorded: a transaction of a connection tallyd had given up on committed it; this copy rolls back',
            flight, worker, id
            USING ERRCODE = 'TD002';
    END IF;
    RETURN true;
END
$$;
