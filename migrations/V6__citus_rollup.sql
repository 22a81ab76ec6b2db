-- The rollup on Citus (docs/scaling.md). On plain PostgreSQL nothing changes: tallyd.rollup()
-- runs the V5 step (now named tallyd.rollup_plain). Once `tallyd migrate` has distributed
-- tallyd.slots (src/store/citus.rs), tallyd.rollup() on the coordinator folds every colocated
-- shard group where it lives instead: Citus refuses a multi-shard FOR UPDATE, but one shard's
-- tables on its own worker are plain tables, where the V5 step works unchanged.

ALTER FUNCTION tallyd.rollup(int) RENAME TO rollup_plain;

-- One rollup step over the given relations: the V5 step (tallyd.rollup_plain) with every table
-- named by an argument, so that it runs on a worker over the colocated shards of one shard
-- group (slots, rollups and rollup_rejects; `targets` names the colocated shard of each
-- rollup_into table). Same claims (FOR UPDATE SKIP LOCKED), same per-key advisory lock, same
-- range guard, one transaction. `targets` is a JSON array of
-- {counter, target, key_column, count_column, key_type}. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_shard(slots regclass, rollups regclass, rejects regclass,
                                    targets jsonb, batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
    n bigint;
    t record;
    k record;
BEGIN
    -- Citus refuses changes to a shard from an ordinary session unless this is on.
    PERFORM set_config('citus.enable_manual_changes_to_shards', 'on', true);
    EXECUTE format($q$
        DELETE FROM %3$s j
        WHERE j.total IS NOT NULL
          AND (SELECT coalesce(sum(p.count), 0) FROM (
                   SELECT r.count FROM %2$s r WHERE r.counter = j.counter AND r.key = j.key
                   UNION ALL
                   SELECT s.count FROM %1$s s WHERE s.counter = j.counter AND s.key = j.key
               ) p) BETWEEN -9223372036854775808 AND 9223372036854775807
    $q$, slots, rollups, rejects);
    EXECUTE format($q$
        DELETE FROM %1$s WHERE total IS NULL AND rejected_at < now() - interval '1 minute'
    $q$, rejects);

    EXECUTE format($q$
        WITH claimed AS (
            SELECT s.counter, s.key, s.slot, s.count, s.first_seen, s.last_seen FROM %1$s s
            WHERE s.counter <> ALL ($2)
              AND NOT EXISTS (SELECT 1 FROM %3$s j WHERE j.counter = s.counter AND j.key = s.key)
            LIMIT $1
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT * FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
        ), summed AS (
            SELECT o.counter, o.key, o.slot, sum(o.count) OVER (PARTITION BY o.counter, o.key) AS added,
                   coalesce((SELECT r.count FROM %2$s r
                             WHERE r.counter = o.counter AND r.key = o.key), 0) AS stored
            FROM owned o
        ), checked AS (
            SELECT counter, key, slot, added + stored AS total,
                   added BETWEEN -9223372036854775808 AND 9223372036854775807
                   AND added + stored BETWEEN -9223372036854775808 AND 9223372036854775807 AS fits
            FROM summed
        ), rejected AS (
            INSERT INTO %3$s AS j (counter, key, total)
            SELECT DISTINCT counter, key, total FROM checked WHERE NOT fits
            ON CONFLICT (counter, key) DO UPDATE SET total = EXCLUDED.total, rejected_at = now()
        ), removed AS (
            DELETE FROM %1$s s
            USING checked c
            WHERE c.fits AND s.counter = c.counter AND s.key = c.key AND s.slot = c.slot
            RETURNING s.counter, s.key, s.count, s.first_seen, s.last_seen
        ), sums AS (
            SELECT counter, key, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n
            FROM removed GROUP BY counter, key
        ), added AS (
            INSERT INTO %2$s AS r (counter, key, count, first_seen, last_seen)
            SELECT counter, key, count, first_seen, last_seen FROM sums
            ON CONFLICT (counter, key) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$, slots, rollups, rejects)
    INTO folded
    USING batch_rows, ARRAY(SELECT jsonb_array_elements(targets) ->> 'counter');

    FOR t IN
        SELECT x.counter, x.target, x.key_column, x.count_column, x.key_type
        FROM jsonb_to_recordset(targets)
             AS x (counter text, target text, key_column name, count_column name, key_type text)
        WHERE x.target IS NOT NULL
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s WHERE s.counter = $1)', slots)
            INTO STRICT k USING t.counter;
        CONTINUE WHEN NOT k.exists;
        BEGIN
            n := tallyd.rollup_into_shard(slots, rejects, t.counter, t.target::regclass,
                                          t.key_column, t.count_column, t.key_type, batch_rows,
                                          NULL);
        EXCEPTION WHEN numeric_value_out_of_range THEN
            n := 0;
            FOR k IN EXECUTE format($q$
                SELECT DISTINCT s.key FROM %1$s s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM %2$s j WHERE j.counter = s.counter AND j.key = s.key)
                LIMIT $2
            $q$, slots, rejects) USING t.counter, batch_rows
            LOOP
                BEGIN
                    n := n + tallyd.rollup_into_shard(slots, rejects, t.counter, t.target::regclass,
                                                      t.key_column, t.count_column, t.key_type,
                                                      batch_rows, k.key);
                EXCEPTION WHEN numeric_value_out_of_range THEN
                    EXECUTE format($q$
                        INSERT INTO %1$s AS j (counter, key, total) VALUES ($1, $2, NULL)
                        ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now()
                    $q$, rejects) USING t.counter, k.key;
                END;
            END LOOP;
        END;
        folded := folded + n;
    END LOOP;
    RETURN folded;
END
$$;

-- tallyd.rollup_into_step (V5) over the given slots and rollup_rejects relations.
CREATE FUNCTION tallyd.rollup_into_shard(slots regclass, rejects regclass, counter text,
                                         target regclass, key_column name, count_column name,
                                         key_type text, batch_rows int, only_key text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    EXECUTE format($step$
        WITH claimed AS (
            SELECT s.key, s.slot FROM %5$s s
            WHERE s.counter = $1
              AND ($3::text IS NULL OR s.key = $3)
              AND NOT EXISTS (SELECT 1 FROM %6$s j
                              WHERE j.counter = s.counter AND j.key = s.key)
              AND EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%4$s)
            LIMIT $2
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT key, slot FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext($1 || E'\n' || key))
        ), targets AS (
            SELECT u.%2$I AS k FROM %1$s u
            WHERE u.%2$I IN (SELECT key::%4$s FROM owned)
            FOR NO KEY UPDATE OF u SKIP LOCKED
        ), folding AS (
            SELECT o.key, o.slot FROM owned o WHERE o.key::%4$s IN (SELECT k FROM targets)
        ), removed AS (
            DELETE FROM %5$s s USING folding f
            WHERE s.counter = $1 AND s.key = f.key AND s.slot = f.slot
            RETURNING s.key, s.count
        ), sums AS (
            SELECT key::%4$s AS k, sum(count)::bigint AS count, count(*) AS n
            FROM removed GROUP BY 1
        ), updated AS (
            UPDATE %1$s u SET %3$I = coalesce(u.%3$I, 0) + sums.count
            FROM sums WHERE u.%2$I = sums.k
        )
        SELECT coalesce(sum(n), 0) FROM sums
    $step$, target, key_column, count_column, key_type, slots, rejects)
    INTO n USING counter, batch_rows, only_key;
    RETURN n;
END
$$;

-- On the coordinator of a Citus cluster: one tallyd.rollup_shard per shard group, each on the
-- worker holding it, in parallel, each its own transaction there (master_run_on_worker opens
-- its own connections). Every shard group's step is exact on its own, so a step that fails on
-- one worker leaves the others' folds committed and loses nothing. Returns the slot rows
-- folded; `batch_rows` bounds each shard group's step.
CREATE FUNCTION tallyd.rollup_citus(batch_rows int) RETURNS bigint
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
                           'key_type', format_type(a.atttypid, a.atttypmod)))
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

-- One rollup step, as the daemon, `tallyd rollup` and pg_cron call it: per shard group on a
-- Citus cluster whose tallyd.slots is distributed, else the V5 step.
CREATE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    RETURN tallyd.rollup_plain(batch_rows);
END
$$;

-- Whether `rel` is a distributed (hash) table of Citus; false without Citus.
CREATE FUNCTION tallyd.is_distributed(rel regclass) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    found boolean;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1 AND partmethod = ''h'')'
        INTO found USING rel;
    RETURN found;
END
$$;
