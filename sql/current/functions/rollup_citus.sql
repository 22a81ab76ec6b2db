-- tallyd.rollup_citus: last changed by migrations/V13__citus_rollup_fixes.sql (changed in V6, V13)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- On the coordinator of a Citus cluster: one tallyd.rollup_shard per shard group, each on the
-- worker holding it, in parallel, each its own transaction there (master_run_on_worker opens its
-- own connections). Every shard group's step is exact on its own, so a step that fails on one
-- worker leaves the others' folds committed and loses nothing. Returns the slot rows folded;
-- `batch_rows` bounds each shard group's step. Each rollup_into target's JSON carries its kind
-- (V13: without it a max or min column on Citus received the number of events, and a unique
-- counter's hll column failed every step of its shard group).
CREATE OR REPLACE FUNCTION tallyd.rollup_citus(batch_rows integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    nodes text[];
    ports int[];
    commands text[];
    folded bigint := 0;
    r record;
BEGIN
    EXECUTE $q$
        SELECT array_agg(n.nodename), array_agg(n.nodeport),
               array_agg(format('SELECT tallyd.rollup_shard(%L, %L, %L, %L, %s)',
                   shard_name('tallyd.slots'::regclass, s.shardid),
                   shard_name('tallyd.rollups'::regclass, r.shardid),
                   shard_name('tallyd.rollup_rejects'::regclass, j.shardid),
                   coalesce((
                       SELECT jsonb_agg(jsonb_build_object(
                           'counter', t.counter,
                           'target', shard_name(t.target, u.shardid),
                           'key_column', t.key_column,
                           'count_column', t.count_column,
                           'key_type', format_type(a.atttypid, a.atttypmod),
                           'kind', t.kind))
                       FROM tallyd.rollup_targets t
                       JOIN pg_attribute a ON a.attrelid = t.target AND a.attname = t.key_column
                       -- No colocated shard (not distributed with tallyd.slots): the
                       -- counter is still kept out of tallyd.rollups, and left in slots.
                       LEFT JOIN pg_dist_shard u ON u.logicalrelid = t.target
                                                AND u.shardminvalue = s.shardminvalue), '[]'),
                   $1))
        FROM pg_dist_shard s
        JOIN pg_dist_shard r ON r.logicalrelid = 'tallyd.rollups'::regclass
                            AND r.shardminvalue = s.shardminvalue
        JOIN pg_dist_shard j ON j.logicalrelid = 'tallyd.rollup_rejects'::regclass
                            AND j.shardminvalue = s.shardminvalue
        JOIN pg_dist_placement p ON p.shardid = s.shardid
        JOIN pg_dist_node n ON n.groupid = p.groupid
        WHERE s.logicalrelid = 'tallyd.slots'::regclass
    $q$ INTO nodes, ports, commands USING batch_rows;
    IF commands IS NULL THEN
        RETURN 0;
    END IF;
    FOR r IN EXECUTE 'SELECT * FROM master_run_on_worker($1, $2, $3, true)'
        USING nodes, ports, commands
    LOOP
        IF NOT r.success THEN
            RAISE EXCEPTION 'tallyd rollup on worker %:% failed: %', r.node_name, r.node_port, r.result;
        END IF;
        folded := folded + r.result::bigint;
    END LOOP;
    RETURN folded;
END
$function$;
