-- How far a writer's unique counters' lines are committed, beside `journal_covered`. While a
-- database lacks the hll extension (`DROP EXTENSION hll CASCADE`), a flush worker holds its
-- unique counters' rows back and commits the rest of each flight (src/flush/held.rs): such a
-- flight's `journal_covered` covers every other line of its records, but the held unique lines
-- only up to `unique_covered`. A replay after a crash replays a unique counter's lines above
-- `unique_covered` and every other line above `journal_covered`, so nothing held is lost and
-- nothing committed is counted twice. NULL (every row before V21): the same as
-- `journal_covered`.
ALTER TABLE tallyd.flushes ADD COLUMN unique_covered bigint;

-- The ledger write of every flush, with `unique_covered`: never lowered, as `journal_covered`
-- is not (a flight that holds unique rows sends the position before the first flight that held
-- some, which is at most what is recorded).
DROP FUNCTION tallyd.record_flush(text, text, integer, bigint, bigint);
CREATE FUNCTION tallyd.record_flush(id text, holder text, worker integer, flight bigint,
                                    covered bigint, unique_covered bigint DEFAULT NULL)
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
