-- tallyd.install_rollup_targets: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- (Re)generates the step function of every recorded rollup_into target (rollup_target_function)
-- and drops those of targets no longer recorded; tallyd calls it in the transaction that records
-- the targets (src/store/targets.rs). A target whose table or columns do not exist gets none and
-- folds nothing until a start records it again (its rows stay in tallyd.slots, out of
-- tallyd.rollups, as V11 left them). Not on Citus: tallyd.rollup_citus folds each shard group with
-- V13's functions. The generated functions are not in this folder: tests/schema.rs prepares a
-- database without rollup_into counters.
CREATE OR REPLACE FUNCTION tallyd.install_rollup_targets()
 RETURNS void
 LANGUAGE plpgsql
AS $function$
DECLARE
    f record;
    t jsonb;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure AS sig FROM pg_proc p
        WHERE p.pronamespace = 'tallyd'::regnamespace AND p.proname LIKE 'rollup\_into\_step\_%'
    LOOP
        EXECUTE format('DROP FUNCTION %s', f.sig);
    END LOOP;
    IF tallyd.is_distributed('tallyd.slots') THEN
        RETURN;
    END IF;
    FOR t IN SELECT x FROM jsonb_array_elements(tallyd.rollup_targets_json()) x
             WHERE x ->> 'target' IS NOT NULL
    LOOP
        EXECUTE tallyd.rollup_target_function(t);
    END LOOP;
END
$function$;
