-- Two fixes of the rollup on Citus (docs/scaling.md, "Citus"), found when tests/citus.rs first
-- ran against a real cluster with V11 and V12 in place.

-- tallyd.held_back() (V11) on Citus. V11 wrote it as an SQL function counting each held key's
-- slot rows in a LATERAL subquery over tallyd.slots; Citus cannot plan that ("cannot perform
-- distributed planning on this query because parameterized queries for SQL functions referencing
-- distributed tables are not supported", and as a plain query: "Aggregates without group by are
-- currently unsupported when a lateral subquery references a column from complex subqueries,
-- CTEs or local tables"), so every `tallyd rollup` and every rollup pass of a daemon with a
-- rollup_into counter failed on Citus, even with tallyd.rollup_held empty (it always is there:
-- windowed rollup_into is refused on Citus). Same result, now counted key by key: each count
-- names one key, which Citus routes to its shard, and tallyd.rollup_held holds few keys (those
-- whose row a foreign key refuses), each counted through the primary key's index.
CREATE OR REPLACE FUNCTION tallyd.held_back()
RETURNS TABLE (counter text, keys bigint, slot_rows bigint, example_key text, cause text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h record;
    n bigint;
BEGIN
    FOR h IN
        SELECT x.counter AS c, x.key AS k, x.cause AS why, r.span
        FROM tallyd.rollup_held x
        JOIN tallyd.rollup_targets r ON r.counter = x.counter
        ORDER BY x.counter, x.key
    LOOP
        SELECT count(*) INTO n FROM tallyd.slots s
        WHERE s.counter = h.c AND s.key = h.k AND s.span = h.span;
        -- A held key with no slot rows left is not counted (its next retry deletes it).
        CONTINUE WHEN n = 0;
        IF counter IS DISTINCT FROM h.c THEN
            IF counter IS NOT NULL THEN
                RETURN NEXT;
            END IF;
            -- The first key of the counter in key order, and the error of its last try.
            counter := h.c;
            keys := 0;
            slot_rows := 0;
            example_key := h.k;
            cause := h.why;
        END IF;
        keys := keys + 1;
        slot_rows := slot_rows + n;
    END LOOP;
    IF counter IS NOT NULL THEN
        RETURN NEXT;
    END IF;
END
$$;

-- tallyd.rollup_citus (V6) as before, with each rollup_into target's kind in the JSON it sends
-- to the workers. V12's tallyd.rollup_shard folds a max, min or unique counter's target with
-- tallyd.rollup_into_kind when the target says its kind; V6 built the targets before kinds
-- existed, so on Citus such a target was folded as a sum: a max or min column received the
-- number of events (silently wrong), and a unique counter's hll column failed every step of
-- its shard group ("COALESCE types hll and integer cannot be matched").
CREATE OR REPLACE FUNCTION tallyd.rollup_citus(batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
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
$$;
