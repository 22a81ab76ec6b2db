-- tallyd.check_shard_map: last changed by migrations/V8__shard_map_version.sql (changed in V8)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- First in every flush transaction: true while this database's shard map version
-- (tallyd.shard_map_version) is `expected`, else an error with SQLSTATE TD001 (the daemon stops
-- on it instead of retrying). The ACCESS SHARE lock is held to the flush's commit, and a move
-- takes ACCESS EXCLUSIVE before it reads the rows it moves: a move waits for the flushes already
-- past this check, and a flush that comes later waits for the move's commit (or rollback) and then
-- reads the new version. The SELECT, a statement of its own in a volatile function, reads a
-- snapshot taken once the lock is granted.
CREATE OR REPLACE FUNCTION tallyd.check_shard_map(expected bigint)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
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
$function$;
