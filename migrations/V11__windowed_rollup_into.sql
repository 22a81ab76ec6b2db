-- Windowed rollup_into (docs/design.md, "Rollup"): a windowed counter folds the rows of its
-- window into the application's (key, window) table, e.g. crates.io's
-- version_downloads(version_id, date, downloads). Its `also` rows (coarser windows, all-time)
-- fold into tallyd.rollups as before. With insert_missing, a (key, window) row the table lacks is
-- inserted (INSERT ... ON CONFLICT (key_column, window_column) DO UPDATE); a key whose insert
-- fails on a foreign key (its parent row does not exist yet, or was deleted) stays in
-- tallyd.slots, recorded in tallyd.rollup_held, and is retried until it folds.
--
-- Plain PostgreSQL only: tallyd refuses a windowed rollup_into on Citus at start
-- (src/store/citus.rs), so the functions below use tallyd's own tables. All-time targets fold as
-- before, on both.

-- Existing rows are all-time targets and keep working as they did.
ALTER TABLE tallyd.rollup_targets
    -- The target's column matched against the window (NULL: an all-time target).
    ADD COLUMN window_column  name,
    -- The counter's window span: only slot rows of this span go to the target ('all': every
    -- row of an all-time counter, as before).
    ADD COLUMN span           text    NOT NULL DEFAULT 'all',
    -- The counter's time_zone: a date window column holds the window's first day there.
    ADD COLUMN time_zone      text    NOT NULL DEFAULT 'UTC',
    -- Insert missing (key, window) rows instead of leaving their counts in tallyd.slots.
    ADD COLUMN insert_missing boolean NOT NULL DEFAULT false;

-- Keys of insert_missing targets whose insert failed on a foreign key. Their slot rows stay in
-- tallyd.slots (tallyd.window_totals and table plus slots stay exact); the batch fold skips them,
-- and each is retried on its own 1 s after it was held, then after 2, 4, ... up to 60 s between
-- tries, and deleted from here once it folds. The daemon reports them (tallyd.held_back()).
CREATE TABLE tallyd.rollup_held (
    counter  text        NOT NULL,
    key      text        NOT NULL,
    -- The error of the last try (names the constraint).
    cause    text        NOT NULL,
    held_at  timestamptz NOT NULL DEFAULT now(),
    attempts int         NOT NULL DEFAULT 1,
    retry_at timestamptz NOT NULL DEFAULT now() + interval '1 second',
    PRIMARY KEY (counter, key)
);

-- The value of a target's window column for the slot row aliased `alias`: the window's first
-- instant (a timestamptz column), or its first day in `time_zone` (a date column). The day is
-- read 12 hours into the window, so that a server whose zone database puts midnight an hour or
-- two away from tallyd's (an older tzdata) still names the same day.
CREATE FUNCTION tallyd.window_value(alias text, window_type text, time_zone text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN window_type = 'date'
                THEN format('((%I.win + interval ''12 hours'') AT TIME ZONE %L)::date', alias, time_zone)
                ELSE format('%I.win', alias) END
$$;

-- The fold of one windowed target, in one statement, optionally for one key only: up to
-- batch_rows slot rows of its window span, claimed with FOR UPDATE SKIP LOCKED, kept only for
-- keys whose per-key advisory lock is free (as every rollup step), deleted, and their sums added
-- to the target's (key, window) rows. Rows of the target the application holds are skipped
-- (SKIP LOCKED) and left to a later step. Without insert_missing only existing (key, window)
-- rows are claimed; with it, missing ones are inserted. Keys in tallyd.rollup_rejects, and held
-- keys unless `only_key` names one, are left alone. Raises numeric_value_out_of_range (the
-- column's type) and foreign_key_violation (an insert's parent row is missing); the caller
-- (tallyd.rollup_into_windows) then goes key by key. `target` is an element of
-- tallyd.rollup_shard's `targets`. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_into_window(target jsonb, batch_rows int, only_key text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    insert_missing boolean := (target ->> 'insert_missing')::boolean;
    window_type text := target ->> 'window_type';
    zone text := target ->> 'time_zone';
    -- %1$s the target table, %2$I its key column, %3$I its window column, %4$I its count
    -- column, %5$s the key column's type; %6$s, %7$s and %8$s the window column's value of the
    -- slot rows aliased s, o and r.
    args text[] := ARRAY[(target ->> 'target')::regclass::text, target ->> 'key_column',
                         target ->> 'window_column', target ->> 'count_column',
                         target ->> 'key_type', tallyd.window_value('s', window_type, zone),
                         tallyd.window_value('o', window_type, zone),
                         tallyd.window_value('r', window_type, zone)];
    -- Without insert_missing: only slot rows whose (key, window) row exists are claimed (others
    -- would fill the batch and never fold), and the fold updates those rows.
    claim text := CASE WHEN insert_missing THEN 'true' ELSE
        'EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%5$s AND u.%3$I = %6$s)' END;
    missing text := CASE WHEN insert_missing THEN
        'OR NOT EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = o.key::%5$s AND u.%3$I = %7$s)'
        ELSE '' END;
    write text := CASE WHEN insert_missing THEN $w$
            INSERT INTO %1$s AS u (%2$I, %3$I, %4$I)
            SELECT k, w, count FROM sums
            ON CONFLICT (%2$I, %3$I) DO UPDATE SET %4$I = coalesce(u.%4$I, 0) + EXCLUDED.%4$I
        $w$ ELSE $w$
            UPDATE %1$s u SET %4$I = coalesce(u.%4$I, 0) + sums.count
            FROM sums WHERE u.%2$I = sums.k AND u.%3$I = sums.w
        $w$ END;
    step text := $step$
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.key, s.win, s.slot FROM tallyd.slots s
            WHERE s.counter = $1 AND s.span = $4
              AND ($3::text IS NULL OR s.key = $3)
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
              AND ($3::text IS NOT NULL OR NOT EXISTS (
                       SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key))
              AND %9$s
            LIMIT $2
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT key, win, slot FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext($1 || E'\n' || key))
        ), existing AS (
            SELECT u.%2$I AS k, u.%3$I AS w FROM %1$s u
            WHERE (u.%2$I, u.%3$I) IN (SELECT o.key::%5$s, %7$s FROM owned o)
            FOR NO KEY UPDATE OF u SKIP LOCKED
        ), folding AS (
            -- Rows whose target row this step holds, and with insert_missing those with none
            -- yet (a row another transaction holds exists, so it is skipped, never waited on).
            SELECT o.key, o.win, o.slot FROM owned o
            WHERE (o.key::%5$s, %7$s) IN (SELECT k, w FROM existing) %10$s
        ), removed AS (
            DELETE FROM tallyd.slots s USING folding f
            WHERE s.counter = $1 AND s.key = f.key AND s.span = $4 AND s.win = f.win
              AND s.slot = f.slot
            RETURNING s.key, s.win, s.count
        ), sums AS (
            -- Grouped by the target's values: keys that cast alike share a row.
            SELECT r.key::%5$s AS k, %8$s AS w, sum(r.count)::bigint AS count, count(*) AS n
            FROM removed r GROUP BY 1, 2
        ), written AS (%11$s)
        SELECT coalesce(sum(n), 0) FROM sums
    $step$;
    n bigint;
BEGIN
    EXECUTE format(step, VARIADIC args || ARRAY[format(claim, VARIADIC args),
                                                format(missing, VARIADIC args),
                                                format(write, VARIADIC args)])
    INTO n
    USING target ->> 'counter', batch_rows, only_key, target ->> 'span';
    RETURN n;
END
$$;

-- The fold (V10's text) keeps out of tallyd.rollups only the (counter, span) rows that go to a
-- target: every row of an all-time rollup_into counter, as before, and the window's rows of a
-- windowed one, whose `also` rows now fold into tallyd.rollups like any counter's.
DO $migration$
DECLARE
    -- %1$s, %2$s and %3$s stand for the slots, rollups and rollup_rejects relations; $1 is
    -- batch_rows and $2 the rows kept out of rollups, as counter || E'\n' || span
    -- (the rollup_into targets).

    -- Summary keys held back earlier whose every window's total fits again (a negative delta
    -- came). A key is held back whole, all its windows with it.
    release text := $q$
        DELETE FROM %3$s j
        WHERE j.total IS NOT NULL
          AND NOT EXISTS (
              SELECT 1 FROM (
                  SELECT r.span, r.win, r.count FROM %2$s r WHERE r.counter = j.counter AND r.key = j.key
                  UNION ALL
                  SELECT s.span, s.win, s.count FROM %1$s s WHERE s.counter = j.counter AND s.key = j.key
              ) p
              GROUP BY p.span, p.win
              HAVING sum(p.count) NOT BETWEEN -9223372036854775808 AND 9223372036854775807)
    $q$;
    -- rollup_into keys are retried after a minute: the target column's type decides.
    expire text := $q$
        DELETE FROM %3$s WHERE total IS NULL AND rejected_at < now() - interval '1 minute'
    $q$;
    -- The fold; returns the slot rows folded.
    fold text := $q$
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.counter, s.key, s.span, s.win, s.slot, s.count, s.first_seen, s.last_seen FROM %1$s s
            WHERE s.counter || E'\n' || s.span <> ALL ($2)
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
            SELECT o.counter, o.key, o.span, o.win, o.slot,
                   sum(o.count) OVER (PARTITION BY o.counter, o.key, o.span, o.win) AS added,
                   coalesce((SELECT r.count FROM %2$s r
                             WHERE r.counter = o.counter AND r.key = o.key
                               AND r.span = o.span AND r.win = o.win), 0) AS stored
            FROM owned o
        ), checked AS (
            SELECT counter, key, span, win, slot, added + stored AS total,
                   added BETWEEN -9223372036854775808 AND 9223372036854775807
                   AND added + stored BETWEEN -9223372036854775808 AND 9223372036854775807 AS fits
            FROM summed
        ), rejected AS (
            INSERT INTO %3$s AS j (counter, key, total)
            SELECT counter, key, max(total) FROM checked WHERE NOT fits GROUP BY counter, key
            ON CONFLICT (counter, key) DO UPDATE SET total = EXCLUDED.total, rejected_at = now()
        ), removed AS (
            DELETE FROM %1$s s
            USING checked c
            WHERE c.fits AND s.counter = c.counter AND s.key = c.key AND s.span = c.span
              AND s.win = c.win AND s.slot = c.slot
            RETURNING s.counter, s.key, s.span, s.win, s.count, s.first_seen, s.last_seen
        ), sums AS (
            SELECT counter, key, span, win, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n
            FROM removed GROUP BY counter, key, span, win
        ), added AS (
            INSERT INTO %2$s AS r (counter, key, span, win, count, first_seen, last_seen)
            SELECT counter, key, span, win, count, first_seen, last_seen FROM sums
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$;
BEGIN
    EXECUTE format($f$
        -- The fold of one rollup step (migrations/V7, windows: V10, V11) over the given relations.
        CREATE OR REPLACE FUNCTION tallyd.rollup_fold(slots regclass, rollups regclass, rejects regclass,
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
        -- tallyd.rollup_fold over tallyd's own tables, as static statements (migrations/V7, V10, V11).
        CREATE OR REPLACE FUNCTION tallyd.rollup_fold_own(batch_rows int, kept text[]) RETURNS bigint
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

-- The windowed part of one rollup step for one target: keys held by a foreign key whose retry
-- is due, each on its own, then one batch; if the batch raises (a key's column would leave its
-- type's range, or an insert's parent row is missing), key by key instead, each in its own
-- subtransaction, holding back only the keys that fail: a range error in tallyd.rollup_rejects
-- (retried after a minute, as for all-time targets), a foreign key in tallyd.rollup_held. The
-- keys are those the batch could claim (without insert_missing, only keys with a window whose
-- row exists: others would never fold and must not fill the window), those with a row to
-- insert first, then in key order, so that successive steps page through them as their rows
-- fold away. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_into_windows(target jsonb, batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    counter_name text := target ->> 'counter';
    window_type text := target ->> 'window_type';
    zone text := target ->> 'time_zone';
    n bigint := 0;
    k record;
BEGIN
    FOR k IN
        SELECT h.key FROM tallyd.rollup_held h
        WHERE h.counter = counter_name AND h.retry_at <= now()
        ORDER BY h.retry_at, h.key
        LIMIT batch_rows
    LOOP
        BEGIN
            n := n + tallyd.rollup_into_window(target, batch_rows, k.key);
            DELETE FROM tallyd.rollup_held h WHERE h.counter = counter_name AND h.key = k.key;
        EXCEPTION
            WHEN foreign_key_violation THEN
                UPDATE tallyd.rollup_held h SET
                    cause = SQLERRM,
                    attempts = h.attempts + 1,
                    retry_at = now() + least(interval '60 seconds',
                                             interval '1 second' * 2 ^ least(h.attempts, 6))
                WHERE h.counter = counter_name AND h.key = k.key;
            WHEN numeric_value_out_of_range THEN
                DELETE FROM tallyd.rollup_held h WHERE h.counter = counter_name AND h.key = k.key;
                INSERT INTO tallyd.rollup_rejects AS j (counter, key, total) VALUES (counter_name, k.key, NULL)
                ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now();
        END;
    END LOOP;

    BEGIN
        n := n + tallyd.rollup_into_window(target, batch_rows, NULL);
    EXCEPTION WHEN numeric_value_out_of_range OR foreign_key_violation THEN
        FOR k IN EXECUTE format($keys$
            SELECT s.key FROM tallyd.slots s
            WHERE s.counter = $1 AND s.span = $3
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h
                              WHERE h.counter = s.counter AND h.key = s.key)
            GROUP BY s.key
            HAVING $4 OR bool_or(EXISTS (SELECT 1 FROM %1$s u
                                         WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s))
            -- Keys with a (key, window) row to insert first: only an insert can fail on a
            -- foreign key, and the key that does (a version just published: the highest id)
            -- must not wait behind every key that only updates.
            ORDER BY bool_and(EXISTS (SELECT 1 FROM %1$s u
                                      WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s)), s.key
            LIMIT $2
        $keys$, (target ->> 'target')::regclass, target ->> 'key_column', target ->> 'key_type',
             target ->> 'window_column', tallyd.window_value('s', window_type, zone))
        USING counter_name, batch_rows, target ->> 'span', (target ->> 'insert_missing')::boolean
        LOOP
            BEGIN
                n := n + tallyd.rollup_into_window(target, batch_rows, k.key);
            EXCEPTION
                WHEN foreign_key_violation THEN
                    INSERT INTO tallyd.rollup_held AS h (counter, key, cause)
                    VALUES (counter_name, k.key, SQLERRM)
                    ON CONFLICT (counter, key) DO UPDATE SET cause = EXCLUDED.cause;
                WHEN numeric_value_out_of_range THEN
                    INSERT INTO tallyd.rollup_rejects AS j (counter, key, total)
                    VALUES (counter_name, k.key, NULL)
                    ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now();
            END;
        END LOOP;
    END;
    RETURN n;
END
$$;

-- One rollup step over the given relations (V7), with windowed targets: the fold keeps out of
-- `rollups` only the rows that go to a target (an all-time target's rows, a windowed target's
-- window rows), and each windowed target folds through tallyd.rollup_into_windows. `targets`
-- elements carry span ('all', or absent: an all-time target, as before), and for a windowed
-- target window_column, window_type, time_zone and insert_missing. Returns the slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_shard(slots regclass, rollups regclass, rejects regclass,
                                               targets jsonb, batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    kept text[] := ARRAY(SELECT (x ->> 'counter') || E'\n' || coalesce(x ->> 'span', 'all')
                         FROM jsonb_array_elements(targets) x);
    folded bigint;
    n bigint;
    pending boolean;
    w jsonb;
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

    FOR w IN SELECT x FROM jsonb_array_elements(targets) x WHERE x ->> 'target' IS NOT NULL
    LOOP
        SELECT x.* INTO t
        FROM jsonb_to_record(w)
             AS x (counter text, target text, key_column name, count_column name, key_type text,
                   span text);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s WHERE s.counter = $1)', slots)
            INTO pending USING t.counter;
        CONTINUE WHEN NOT pending;
        IF coalesce(t.span, 'all') <> 'all' THEN
            folded := folded + tallyd.rollup_into_windows(w, batch_rows);
            CONTINUE;
        END IF;
        BEGIN
            n := tallyd.rollup_into_shard(slots, rejects, t.counter, t.target::regclass,
                                          t.key_column, t.count_column, t.key_type, batch_rows,
                                          NULL);
        EXCEPTION WHEN numeric_value_out_of_range THEN
            -- As V7: key by key, among the keys that have a row in the target, in key order.
            n := 0;
            FOR k IN EXECUTE format($q$
                SELECT DISTINCT s.key FROM %1$s s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM %2$s j WHERE j.counter = s.counter AND j.key = s.key)
                  AND EXISTS (SELECT 1 FROM %3$s u WHERE u.%4$I = s.key::%5$s)
                ORDER BY s.key
                LIMIT $2
            $q$, slots, rejects, t.target::regclass, t.key_column, t.key_type)
                USING t.counter, batch_rows
            LOOP
                BEGIN
                    n := n + tallyd.rollup_into_shard(slots, rejects, t.counter,
                                                      t.target::regclass, t.key_column,
                                                      t.count_column, t.key_type, batch_rows,
                                                      k.key);
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

-- The targets of tallyd.rollup_shard over tallyd's own tables, from tallyd.rollup_targets. A
-- target whose key or window column no longer exists is kept out of tallyd.rollups but not
-- folded (as V7).
CREATE FUNCTION tallyd.rollup_targets_json() RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'counter', r.counter,
               'target', CASE WHEN a.attname IS NOT NULL
                               AND (r.window_column IS NULL OR w.attname IS NOT NULL)
                              THEN r.target::text END,
               'key_column', r.key_column,
               'count_column', r.count_column,
               'key_type', format_type(a.atttypid, a.atttypmod),
               'span', r.span,
               'window_column', r.window_column,
               'window_type', CASE format_type(w.atttypid, w.atttypmod)
                                  WHEN 'date' THEN 'date' ELSE 'timestamptz' END,
               'time_zone', r.time_zone,
               'insert_missing', r.insert_missing)), '[]')
    FROM tallyd.rollup_targets r
    LEFT JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
    LEFT JOIN pg_attribute w ON w.attrelid = r.target AND w.attname = r.window_column
$$;

-- One rollup step, as the daemon, `tallyd rollup` and pg_cron call it (V7), with the targets'
-- windows.
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    RETURN tallyd.rollup_shard('tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects',
                               tallyd.rollup_targets_json(), batch_rows);
END
$$;

-- Slot rows of rollup_into counters that wait for a row of the target table (V2): for an
-- all-time target, keys without a row; for a windowed one without insert_missing, rows whose
-- (key, window) has none. A windowed target with insert_missing inserts what is missing: 0 (its
-- keys held by a foreign key are reported by tallyd.held_back()).
CREATE OR REPLACE FUNCTION tallyd.unmatched() RETURNS TABLE (counter text, slot_rows bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT x.counter, x.target::regclass AS target, x.key_column, x.key_type, x.span,
               x.window_column, x.window_type, x.time_zone, x.insert_missing
        FROM jsonb_to_recordset(tallyd.rollup_targets_json())
             AS x (counter text, target text, key_column name, key_type text, span text,
                   window_column name, window_type text, time_zone text, insert_missing boolean)
        WHERE x.target IS NOT NULL
    LOOP
        IF t.span = 'all' THEN
            RETURN QUERY EXECUTE format($q$
                SELECT $1, count(*) FROM tallyd.slots s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%3$s)
            $q$, t.target, t.key_column, t.key_type) USING t.counter;
        ELSIF t.insert_missing THEN
            RETURN QUERY SELECT t.counter, 0::bigint;
        ELSE
            RETURN QUERY EXECUTE format($q$
                SELECT $1, count(*) FROM tallyd.slots s
                WHERE s.counter = $1 AND s.span = $2
                  AND NOT EXISTS (SELECT 1 FROM %1$s u
                                  WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s)
            $q$, t.target, t.key_column, t.key_type, t.window_column,
                 tallyd.window_value('s', t.window_type, t.time_zone))
                USING t.counter, t.span;
        END IF;
    END LOOP;
END
$$;

-- Keys of insert_missing targets held back by a foreign key (tallyd.rollup_held), per counter:
-- how many, their slot rows waiting, and the first key with the error of its last try. A held
-- key with no slot rows left (deleted by retention or by hand) is not counted; its next retry
-- deletes it.
CREATE FUNCTION tallyd.held_back()
RETURNS TABLE (counter text, keys bigint, slot_rows bigint, example_key text, cause text)
LANGUAGE sql STABLE AS $$
    SELECT h.counter, count(*), coalesce(sum(c.n), 0)::bigint,
           min(h.key), (array_agg(h.cause ORDER BY h.key))[1]
    FROM tallyd.rollup_held h
    JOIN tallyd.rollup_targets r ON r.counter = h.counter
    CROSS JOIN LATERAL (SELECT count(*) AS n FROM tallyd.slots s
                        WHERE s.counter = h.counter AND s.key = h.key AND s.span = r.span) c
    WHERE c.n > 0
    GROUP BY h.counter
$$;
