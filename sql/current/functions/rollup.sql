-- tallyd.rollup: last changed by migrations/V11__windowed_rollup_into.sql (changed in V2, V5, V6, V7, V11)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One rollup step, as the daemon, `tallyd rollup` and pg_cron call it; returns the slot rows
-- folded. On a Citus cluster whose tallyd.slots is distributed, one step per shard group on its
-- worker (tallyd.rollup_citus); otherwise one step over tallyd's own tables
-- (tallyd.rollup_shard), with the rollup_into targets from tallyd.rollup_targets_json().
--
-- The call tree (each in its own file here):
--   rollup
--   ├─ is_distributed
--   ├─ rollup_citus ─▶ (on each worker) rollup_shard
--   ├─ rollup_targets_json
--   └─ rollup_shard
--      ├─ rollup_fold_own (tallyd's own tables) │ rollup_fold (any relations)
--      │  └─ rollup_sketches (where the hll extension is installed)
--      ├─ rollup_into_kind (a max, min or unique counter's target)
--      ├─ rollup_into_windows ─▶ rollup_into_window ─▶ window_value (a windowed target)
--      └─ rollup_into_shard (a sum's all-time target)
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows integer DEFAULT 1000)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    RETURN tallyd.rollup_shard('tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects',
                               tallyd.rollup_targets_json(), batch_rows);
END
$function$;
