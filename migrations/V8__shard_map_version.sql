-- The version of this database's shard ownership (`tallyd.shards`). A shard move raises it in
-- every database that loses shards, in the move's own transaction there, so that a tallyd that
-- read the map before the move (another instance, still running by its old map, which writes
-- the moving shards to their source) can no longer flush into this database: each flush checks,
-- in its own transaction, that the version is still the one its start read with the map check.
CREATE TABLE tallyd.shard_map_version (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint  NOT NULL
);
INSERT INTO tallyd.shard_map_version (one, version) VALUES (true, 1);

-- First in every flush transaction: true while the version is `expected`, else an error with
-- SQLSTATE TD001 (the daemon stops on it instead of retrying). The ACCESS SHARE lock is held to
-- the flush's commit, and a move takes ACCESS EXCLUSIVE before it reads the rows it moves: a
-- move waits for the flushes already past this check, and a flush that comes later waits for
-- the move's commit (or rollback) and then reads the new version. The SELECT, a statement of its
-- own in a volatile function, reads a snapshot taken once the lock is granted.
CREATE FUNCTION tallyd.check_shard_map(expected bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    found bigint;
BEGIN
    LOCK TABLE tallyd.shard_map_version IN ACCESS SHARE MODE;
    SELECT version INTO found FROM tallyd.shard_map_version;
    IF found IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'the shard map of this database changed while this tallyd ran (version % at its start, % now): another tallyd moved logical shards',
            expected, found
            USING ERRCODE = 'TD001',
                  HINT = 'start this tallyd again with the new [database] shards and shard_map';
    END IF;
    RETURN true;
END
$$;
