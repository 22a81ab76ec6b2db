-- tallyd.rollup_step: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One step of one unit, as the daemon's scheduler and `tallyd rollup --until-empty` call it
-- (src/rollup/): a counter's rows bound for its rollup_into target (`into_target`) or for
-- tallyd.rollups, after the key `after_key` ('' starts a pass), at most batch_rows rows. Commits
-- without waiting for the WAL to reach the disk (synchronous_commit off for this transaction only):
-- a crash may lose the last steps, and WAL replays in order, so a lost step leaves its rows in
-- tallyd.slots and its target unchanged, still counted once (docs/design.md, "Rollup"). Call it in
-- a transaction of its own.
CREATE OR REPLACE FUNCTION tallyd.rollup_step(counter_name text, counter_kind text, into_target boolean, after_key text, batch_rows integer, OUT folded bigint, OUT claimed bigint, OUT last_key text)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF into_target THEN
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_target(counter_name, after_key, batch_rows) x;
    ELSE
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_summary(counter_name, counter_kind, after_key, batch_rows) x;
    END IF;
END
$function$;
