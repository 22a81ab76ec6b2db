-- tallyd.rollup: last changed by migrations/V14__set_based_rollup.sql (changed in V2, V5, V6, V7, V11, V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One rollup step, as pg_cron and anyone calling SQL run it (the daemon and `tallyd rollup
-- --until-empty` step each unit with a cursor instead: tallyd.rollup_step); returns the slot rows
-- folded. On a Citus cluster whose tallyd.slots is distributed, one step per shard group on its
-- worker (tallyd.rollup_citus, with the functions of V6 to V13). Otherwise, for every counter with
-- slot rows (tallyd.rollup_counters), from its first key: up to batch_rows rows of all counters
-- together bound for tallyd.rollups (tallyd.rollup_summary), and up to batch_rows rows of each
-- rollup_into target (tallyd.rollup_target).
--
-- The call tree (each in its own file here):
--   rollup
--   ├─ is_distributed
--   ├─ rollup_citus ─▶ (on each worker) rollup_shard (V13's tree: rollup_fold, rollup_sketches,
--   │                  rollup_into_kind, rollup_into_shard)
--   ├─ rollup_counters
--   ├─ rollup_summary ─▶ rollup_summary_sketches (a unique counter)
--   └─ rollup_target ─▶ rollup_into_step_<md5> (generated per target by install_rollup_targets
--                       from rollup_target_function)
--   rollup_step (the daemon's) ─▶ rollup_summary │ rollup_target
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows integer DEFAULT 1000)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    c record;
    s record;
    target_span text;
    folded bigint := 0;
    remaining bigint := batch_rows;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    FOR c IN SELECT * FROM tallyd.rollup_counters() LOOP
        target_span := (SELECT t.span FROM tallyd.rollup_targets t WHERE t.counter = c.counter);
        -- An all-time target takes all of its counter's rows; a windowed one its window's.
        IF target_span IS DISTINCT FROM 'all' AND remaining > 0 THEN
            SELECT * INTO s FROM tallyd.rollup_summary(c.counter, c.kind, '', remaining::integer);
            folded := folded + s.folded;
            remaining := remaining - s.claimed;
        END IF;
        IF target_span IS NOT NULL THEN
            SELECT * INTO s FROM tallyd.rollup_target(c.counter, '', batch_rows);
            folded := folded + s.folded;
        END IF;
    END LOOP;
    RETURN folded;
END
$function$;
