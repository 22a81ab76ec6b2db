-- Prototype rollup steps for the issue's windowed target (counter vd, span day, Europe/Berlin,
-- public.version_downloads with insert_missing), written out statically so that PL/pgSQL keeps
-- their plans. Each returns the slot rows folded. Installed into schema rollperf; nothing of
-- tallyd's schema changes. Compare with `SELECT tallyd.rollup(n)` (the live call tree).
CREATE SCHEMA IF NOT EXISTS rollperf;

-- S1: V11's windowed statement (tallyd.rollup_into_window) as it is, but static: no
-- tallyd.rollup_fold_own before it, no per-step planning, no targets JSON, no held-keys loop.
CREATE OR REPLACE FUNCTION rollperf.step_v11_static(batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE folded bigint;
BEGIN
    WITH claimed AS (
        SELECT s.key, s.win, s.slot FROM tallyd.slots s
        WHERE s.counter = 'vd' AND s.span = 'day'
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key)
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), owned AS (
        SELECT key, win, slot FROM claimed
        WHERE pg_try_advisory_xact_lock(1952541816, hashtext('vd' || E'\n' || key))
    ), existing AS (
        SELECT u.version_id AS k, u.date AS w FROM public.version_downloads u
        WHERE (u.version_id, u.date) IN (
            SELECT o.key::bigint, ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date FROM owned o)
        FOR NO KEY UPDATE OF u SKIP LOCKED
    ), folding AS (
        SELECT o.key, o.win, o.slot FROM owned o
        WHERE (o.key::bigint, ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date) IN (SELECT k, w FROM existing)
           OR NOT EXISTS (SELECT 1 FROM public.version_downloads u
                          WHERE u.version_id = o.key::bigint
                            AND u.date = ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date)
    ), removed AS (
        DELETE FROM tallyd.slots s USING folding f
        WHERE s.counter = 'vd' AND s.key = f.key AND s.span = 'day' AND s.win = f.win AND s.slot = f.slot
        RETURNING s.key, s.win, s.count
    ), sums AS (
        SELECT r.key::bigint AS k, ((r.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w,
               sum(r.count)::bigint AS count, count(*) AS n
        FROM removed r GROUP BY 1, 2
    ), written AS (
        INSERT INTO public.version_downloads AS u (version_id, date, downloads)
        SELECT k, w, count FROM sums
        ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads
    )
    SELECT coalesce(sum(sums.n), 0) INTO folded FROM sums;
    RETURN folded;
END
$$;

-- S2: S1 without the per-key advisory locks.
CREATE OR REPLACE FUNCTION rollperf.step_v11_nolock(batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE folded bigint;
BEGIN
    WITH claimed AS (
        SELECT s.key, s.win, s.slot FROM tallyd.slots s
        WHERE s.counter = 'vd' AND s.span = 'day'
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key)
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), owned AS (
        SELECT key, win, slot FROM claimed
    ), existing AS (
        SELECT u.version_id AS k, u.date AS w FROM public.version_downloads u
        WHERE (u.version_id, u.date) IN (
            SELECT o.key::bigint, ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date FROM owned o)
        FOR NO KEY UPDATE OF u SKIP LOCKED
    ), folding AS (
        SELECT o.key, o.win, o.slot FROM owned o
        WHERE (o.key::bigint, ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date) IN (SELECT k, w FROM existing)
           OR NOT EXISTS (SELECT 1 FROM public.version_downloads u
                          WHERE u.version_id = o.key::bigint
                            AND u.date = ((o.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date)
    ), removed AS (
        DELETE FROM tallyd.slots s USING folding f
        WHERE s.counter = 'vd' AND s.key = f.key AND s.span = 'day' AND s.win = f.win AND s.slot = f.slot
        RETURNING s.key, s.win, s.count
    ), sums AS (
        SELECT r.key::bigint AS k, ((r.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w,
               sum(r.count)::bigint AS count, count(*) AS n
        FROM removed r GROUP BY 1, 2
    ), written AS (
        INSERT INTO public.version_downloads AS u (version_id, date, downloads)
        SELECT k, w, count FROM sums
        ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads
    )
    SELECT coalesce(sum(sums.n), 0) INTO folded FROM sums;
    RETURN folded;
END
$$;

-- S3: set-based step, design (b). One statement: claim by ctid (FOR UPDATE SKIP LOCKED), map to
-- the target's (key, window) once, lock the existing target rows in one join
-- (FOR NO KEY UPDATE SKIP LOCKED: a row the application holds is skipped, never waited on),
-- fold the claimed rows whose target row is locked here or missing: delete them by ctid (the
-- row is locked by this transaction, so its ctid cannot move), sum per target row, write in
-- target order (so that two steps inserting the same new rows queue, never deadlock). No
-- advisory locks: see the design note (corrections hold the table lock; a sum commutes).
CREATE OR REPLACE FUNCTION rollperf.step_set(batch_rows int) RETURNS bigint
-- Index probes whatever the statistics say: a plan cached while a table looked empty (a new
-- target, tallyd.slots after a TRUNCATE) must not turn a probe per row into a scan per row.
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE folded bigint;
BEGIN
    WITH claimed AS MATERIALIZED (
        SELECT s.ctid AS tid, s.key::bigint AS k,
               ((s.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w
        FROM tallyd.slots s
        WHERE s.counter = 'vd' AND s.span = 'day'
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key)
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), present AS MATERIALIZED (
        -- Every claimed row's target row as the snapshot sees it (NULL: missing).
        -- LATERAL ... LIMIT 1: one index probe per claimed row whatever the statistics say (a
        -- plan cached while the table was small must not hash the whole table at every step)
        SELECT c.tid, c.k, c.w, u.utid FROM claimed c
        LEFT JOIN LATERAL (SELECT u.ctid AS utid FROM public.version_downloads u
                           WHERE u.version_id = c.k AND u.date = c.w LIMIT 1) u ON true
    ), locked AS (
        SELECT u.ctid AS utid FROM public.version_downloads u
        WHERE u.ctid = ANY (ARRAY(SELECT utid FROM present WHERE utid IS NOT NULL))
        FOR NO KEY UPDATE OF u SKIP LOCKED
    ), removed AS (
        DELETE FROM tallyd.slots s
        WHERE s.ctid = ANY (ARRAY(SELECT p.tid FROM present p
                                  WHERE p.utid IS NULL OR p.utid IN (SELECT utid FROM locked)))
        RETURNING s.key::bigint AS k, ((s.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w, s.count
    ), sums AS (
        SELECT k, w, sum(count)::bigint AS count, count(*) AS n FROM removed GROUP BY k, w
    ), written AS (
        INSERT INTO public.version_downloads AS u (version_id, date, downloads)
        SELECT k, w, count FROM sums ORDER BY k, w
        ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads
    )
    SELECT coalesce(sum(n), 0) INTO folded FROM sums;
    RETURN folded;
END
$$;

-- S4: S3 with a cursor: each step claims in key order after the last key the previous step of
-- this session claimed (kept in the session setting rollperf.cursor; the daemon would keep it in
-- memory), and starts again from the first key when a step finds fewer than batch_rows. So a
-- claim reads batch_rows index entries, not every entry (dead ones included) of the rows that
-- earlier steps deleted: the claims of S1 to S3 restart from the first row of the table at every
-- step (a seq scan or the index), O(rows deleted so far) per step, which is what made the
-- rollup quadratic beside flushes (their transactions keep those dead entries unkillable).
DROP FUNCTION IF EXISTS rollperf.step_set_cursor(int);
CREATE OR REPLACE FUNCTION rollperf.step_set_cursor(batch_rows int, advisory boolean DEFAULT false) RETURNS bigint
-- as rollperf.step_set: index probes whatever the statistics say
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    folded bigint;
    after text := coalesce(current_setting('rollperf.cursor', true), '');
    last_key text;
BEGIN
    WITH claimed AS MATERIALIZED (
        SELECT s.ctid AS tid, s.key, s.key::bigint AS k,
               ((s.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w
        FROM tallyd.slots s
        WHERE s.counter = 'vd' AND s.key > after AND s.span = 'day'
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h WHERE h.counter = s.counter AND h.key = s.key)
        ORDER BY s.key
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), owned AS MATERIALIZED (
        -- only to measure today's per-key advisory locks (advisory = true)
        SELECT * FROM claimed
        WHERE NOT advisory OR pg_try_advisory_xact_lock(1952541816, hashtext('vd' || E'\n' || key))
    ), present AS MATERIALIZED (
        -- LATERAL ... LIMIT 1: one index probe per claimed row whatever the statistics say (a
        -- plan cached while the table was small must not hash the whole table at every step)
        SELECT c.tid, c.k, c.w, u.utid FROM owned c
        LEFT JOIN LATERAL (SELECT u.ctid AS utid FROM public.version_downloads u
                           WHERE u.version_id = c.k AND u.date = c.w LIMIT 1) u ON true
    ), locked AS (
        SELECT u.ctid AS utid FROM public.version_downloads u
        WHERE u.ctid = ANY (ARRAY(SELECT utid FROM present WHERE utid IS NOT NULL))
        FOR NO KEY UPDATE OF u SKIP LOCKED
    ), removed AS (
        DELETE FROM tallyd.slots s
        WHERE s.ctid = ANY (ARRAY(SELECT p.tid FROM present p
                                  WHERE p.utid IS NULL OR p.utid IN (SELECT utid FROM locked)))
        RETURNING s.key::bigint AS k, ((s.win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w, s.count
    ), sums AS (
        SELECT k, w, sum(count)::bigint AS count, count(*) AS n FROM removed GROUP BY k, w
    ), written AS (
        INSERT INTO public.version_downloads AS u (version_id, date, downloads)
        SELECT k, w, count FROM sums ORDER BY k, w
        ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads
    )
    SELECT (SELECT coalesce(sum(n), 0) FROM sums), (SELECT max(key) FROM claimed) INTO folded, last_key;
    -- fewer than a batch: the end of the keys; the next step starts from the first again
    PERFORM set_config('rollperf.cursor', CASE WHEN last_key IS NULL OR folded < batch_rows THEN '' ELSE last_key END, false);
    RETURN folded;
END
$$;

-- S5: design (b) for an all-time sum counter into tallyd.rollups: claim with the key cursor,
-- delete by ctid, sum per (counter, key, span, win), upsert in key order. No advisory locks and
-- no range pre-check: a total beyond bigint raises in the upsert (22003) and the caller runs
-- today's guarded step (tallyd.rollup) instead, which holds the key back.
CREATE OR REPLACE FUNCTION rollperf.step_alltime_cursor(batch_rows int) RETURNS bigint
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    folded bigint;
    after text := coalesce(current_setting('rollperf.cursor_all', true), '');
    last_key text;
BEGIN
    WITH claimed AS MATERIALIZED (
        SELECT s.ctid AS tid, s.key FROM tallyd.slots s
        WHERE s.counter = 'vd' AND s.key > after AND s.span = 'all' AND s.sketch IS NULL
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
        ORDER BY s.key
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), removed AS (
        DELETE FROM tallyd.slots s WHERE s.ctid = ANY (ARRAY(SELECT tid FROM claimed))
        RETURNING s.counter, s.key, s.span, s.win, s.count, s.first_seen, s.last_seen
    ), sums AS (
        SELECT counter, key, span, win, sum(count)::bigint AS count,
               min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n
        FROM removed GROUP BY counter, key, span, win
    ), added AS (
        INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen)
        SELECT counter, key, span, win, count, first_seen, last_seen FROM sums
        ORDER BY counter, key, span, win
        ON CONFLICT (counter, key, span, win) DO UPDATE SET
            count = r.count + EXCLUDED.count,
            first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
            last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)
    )
    SELECT (SELECT coalesce(sum(n), 0) FROM sums), (SELECT max(key) FROM claimed) INTO folded, last_key;
    PERFORM set_config('rollperf.cursor_all', CASE WHEN last_key IS NULL OR folded < batch_rows THEN '' ELSE last_key END, false);
    RETURN folded;
EXCEPTION WHEN numeric_value_out_of_range THEN
    -- a total beyond bigint: this step's fast path rolled back; today's guarded step holds it back
    RETURN tallyd.rollup(batch_rows);
END
$$;
