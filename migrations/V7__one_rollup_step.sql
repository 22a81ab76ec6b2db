-- The rollup step in one place. V6 left two copies of it: tallyd.rollup_plain (the V5 step over
-- tallyd's own tables, with tallyd.rollup_into_step) and tallyd.rollup_shard (the same
-- statements with every table named by an argument, with tallyd.rollup_into_shard, for one
-- Citus shard group on its worker). Now tallyd.rollup_shard is the only step: tallyd.rollup()
-- calls it with tallyd's own tables on plain PostgreSQL (and on a Citus database whose
-- tallyd.slots is not distributed), and tallyd.rollup_citus (V6, unchanged) calls it per shard
-- group as before. tallyd.rollup_plain and tallyd.rollup_into_step are dropped.
--
-- The step is the V5 step: same claims (FOR UPDATE SKIP LOCKED), same per-key advisory lock,
-- same range guard and tallyd.rollup_rejects, one transaction, same result. One difference from
-- V6's rollup_shard, which had drifted from V5: when a rollup_into counter folds key by key
-- (some key's column would leave its type's range), it pages through only the keys that have a
-- row in the target, in key order, as V5 does; V6's copy could fill its window with keys that
-- have none and never reach the others.
--
-- The fold's statements are written once, below, with the three relations as placeholders, and
-- installed twice from that text: tallyd.rollup_fold runs them for any relations (EXECUTE
-- format(...), planned at every call), tallyd.rollup_fold_own runs them over tallyd's own tables
-- as static statements, whose plans PL/pgSQL keeps for the session, as V5's were. A step of
-- tallyd.rollup_shard over tallyd's own tables takes the second: the dynamic statements alone
-- cost 0.5 ms of planning per step, several percent of the CPU of a 1,000-row step
-- (docs/design.md, Rollup).

DO $migration$
DECLARE
    -- %1$s, %2$s and %3$s stand for the slots, rollups and rollup_rejects relations; $1 is
    -- batch_rows and $2 the counters kept out of rollups (the rollup_into counters).

    -- Summary keys held back earlier whose whole total fits again (a negative delta came).
    release text := $q$
        DELETE FROM %3$s j
        WHERE j.total IS NOT NULL
          AND (SELECT coalesce(sum(p.count), 0) FROM (
                   SELECT r.count FROM %2$s r WHERE r.counter = j.counter AND r.key = j.key
                   UNION ALL
                   SELECT s.count FROM %1$s s WHERE s.counter = j.counter AND s.key = j.key
               ) p) BETWEEN -9223372036854775808 AND 9223372036854775807
    $q$;
    -- rollup_into keys are retried after a minute: the target column's type decides.
    expire text := $q$
        DELETE FROM %3$s WHERE total IS NULL AND rejected_at < now() - interval '1 minute'
    $q$;
    -- The fold; returns the slot rows folded.
    fold text := $q$
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.counter, s.key, s.slot, s.count, s.first_seen, s.last_seen FROM %1$s s
            WHERE s.counter <> ALL ($2)
              AND NOT EXISTS (SELECT 1 FROM %3$s j WHERE j.counter = s.counter AND j.key = s.key)
            LIMIT $1
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            -- Once per claimed row: a transaction that holds a key's lock gets it again at
            -- once, so all claimed rows of a key are kept or skipped together.
            SELECT * FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
        ), summed AS (
            -- Per claimed row, its key's claimed sum and the total it would fold to. Window
            -- and subquery, not joins between these CTEs: the plan stays linear in batch_rows.
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
    $q$;
BEGIN
    EXECUTE format($f$
        -- The fold of one rollup step (migrations/V7) over the given relations.
        CREATE FUNCTION tallyd.rollup_fold(slots regclass, rollups regclass, rejects regclass,
                                           batch_rows int, kept text[]) RETURNS bigint
        LANGUAGE plpgsql AS $body$
        DECLARE
            folded bigint;
        BEGIN
            EXECUTE format($q$%1$s$q$, slots, rollups, rejects);
            EXECUTE format($q$%2$s$q$, slots, rollups, rejects);
            EXECUTE format($q$%3$s$q$, slots, rollups, rejects)
                INTO folded USING batch_rows, kept;
            RETURN folded;
        END
        $body$
    $f$, release, expire, fold);

    EXECUTE format($f$
        -- tallyd.rollup_fold over tallyd's own tables, as static statements (migrations/V7).
        CREATE FUNCTION tallyd.rollup_fold_own(batch_rows int, kept text[]) RETURNS bigint
        LANGUAGE plpgsql AS $body$
        DECLARE
            folded bigint;
        BEGIN
            %1$s;
            %2$s;
            %3$s
            INTO folded;
            RETURN folded;
        END
        $body$
    $f$, format(release, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(expire, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(fold, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'));
END
$migration$;

-- One rollup step over the given relations: slots, rollups and rollup_rejects, and for each
-- rollup_into counter its target. On a Citus worker these are the colocated shards of one shard
-- group; on plain PostgreSQL tallyd's own tables. `targets` is a JSON array of
-- {counter, target, key_column, count_column, key_type}; a NULL target keeps the counter out
-- of `rollups` without folding it. Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_shard(slots regclass, rollups regclass, rejects regclass,
                                               targets jsonb, batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    kept text[] := ARRAY(SELECT jsonb_array_elements(targets) ->> 'counter');
    folded bigint;
    n bigint;
    pending boolean;
    t record;
    k record;
BEGIN
    -- Citus refuses changes to a shard from an ordinary session unless this is on. Only where
    -- Citus defines the setting: plain PostgreSQL is left as it was.
    IF current_setting('citus.enable_manual_changes_to_shards', true) IS NOT NULL THEN
        PERFORM set_config('citus.enable_manual_changes_to_shards', 'on', true);
    END IF;

    IF (slots, rollups, rejects) = (to_regclass('tallyd.slots'), to_regclass('tallyd.rollups'),
                                    to_regclass('tallyd.rollup_rejects')) THEN
        folded := tallyd.rollup_fold_own(batch_rows, kept);
    ELSE
        folded := tallyd.rollup_fold(slots, rollups, rejects, batch_rows, kept);
    END IF;

    FOR t IN
        SELECT x.counter, x.target::regclass AS target, x.key_column, x.count_column, x.key_type
        FROM jsonb_to_recordset(targets)
             AS x (counter text, target text, key_column name, count_column name, key_type text)
        WHERE x.target IS NOT NULL
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s WHERE s.counter = $1)', slots)
            INTO pending USING t.counter;
        CONTINUE WHEN NOT pending;
        BEGIN
            n := tallyd.rollup_into_shard(slots, rejects, t.counter, t.target, t.key_column,
                                          t.count_column, t.key_type, batch_rows, NULL);
        EXCEPTION WHEN numeric_value_out_of_range THEN
            -- Some key's column would leave its type's range: fold key by key, each in its own
            -- subtransaction, and hold back only the keys that fail. The keys are the ones
            -- rollup_into_shard can claim (a row in the target table): keys without one are
            -- never folded, and batch_rows of them must not fill the window. In key order, so
            -- that successive steps page through the keys as their rows fold away.
            n := 0;
            FOR k IN EXECUTE format($q$
                SELECT DISTINCT s.key FROM %1$s s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM %2$s j WHERE j.counter = s.counter AND j.key = s.key)
                  AND EXISTS (SELECT 1 FROM %3$s u WHERE u.%4$I = s.key::%5$s)
                ORDER BY s.key
                LIMIT $2
            $q$, slots, rejects, t.target, t.key_column, t.key_type) USING t.counter, batch_rows
            LOOP
                BEGIN
                    n := n + tallyd.rollup_into_shard(slots, rejects, t.counter, t.target,
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

-- One rollup step, as the daemon, `tallyd rollup` and pg_cron call it: per shard group on a
-- Citus cluster whose tallyd.slots is distributed (V6), else over tallyd's own tables.
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    RETURN tallyd.rollup_shard('tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects',
        (SELECT coalesce(jsonb_agg(jsonb_build_object(
                    'counter', r.counter,
                    -- No such column any more: kept out of tallyd.rollups, not folded (as V5).
                    'target', CASE WHEN a.attname IS NOT NULL THEN r.target::text END,
                    'key_column', r.key_column,
                    'count_column', r.count_column,
                    'key_type', format_type(a.atttypid, a.atttypmod))), '[]')
         FROM tallyd.rollup_targets r
         LEFT JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column),
        batch_rows);
END
$$;

DROP FUNCTION tallyd.rollup_plain(int);
DROP FUNCTION tallyd.rollup_into_step(text, regclass, name, name, text, int, text);
