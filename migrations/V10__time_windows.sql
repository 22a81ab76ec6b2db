-- Time windows (docs/design.md, "Time windows"): a row of tallyd.slots and tallyd.rollups is now
-- one (counter, key, span, win): `span` is the window's length ('minute', 'hour', 'day', 'week',
-- 'month', or 'all' for an all-time total) and `win` its first instant ('-infinity' for 'all').
-- Every existing row is an all-time row: it keeps its values, with span 'all' and win
-- '-infinity' from the defaults (no table rewrite). tallyd.totals shows the all-time rows, as
-- before; tallyd.window_totals the windowed ones. The rollup folds per (counter, key, span, win);
-- a key whose fold would leave the 64-bit range is still held back whole (tallyd.rollup_rejects
-- keeps its key, all its windows with it). tallyd.expire_windows deletes a counter's windows
-- older than its retention, in bounded steps.

ALTER TABLE tallyd.slots
    ADD COLUMN span text NOT NULL DEFAULT 'all',
    ADD COLUMN win timestamptz NOT NULL DEFAULT '-infinity';
ALTER TABLE tallyd.slots DROP CONSTRAINT slots_pkey;
ALTER TABLE tallyd.slots ADD PRIMARY KEY (counter, key, span, win, slot);

ALTER TABLE tallyd.rollups
    ADD COLUMN span text NOT NULL DEFAULT 'all',
    ADD COLUMN win timestamptz NOT NULL DEFAULT '-infinity';
ALTER TABLE tallyd.rollups DROP CONSTRAINT rollups_pkey;
ALTER TABLE tallyd.rollups ADD PRIMARY KEY (counter, key, span, win);

-- All-time totals, exact at any moment, as before: the rows of span 'all'.
CREATE OR REPLACE VIEW tallyd.totals AS
SELECT counter, key,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count
FROM (
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.rollups WHERE span = 'all'
    UNION ALL
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.slots WHERE span = 'all'
) AS parts
GROUP BY counter, key;

-- Per window, exact at any moment in the same way: one row per (counter, key, span, window).
-- `window_start` is the window's first instant; `window_start AT TIME ZONE '<the counter's
-- time_zone>'` gives its local start, and `::date` of that its first day.
CREATE VIEW tallyd.window_totals AS
SELECT counter, key, span, win AS window_start,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count
FROM (
    SELECT counter, key, span, win, count, first_seen, last_seen FROM tallyd.rollups WHERE span <> 'all'
    UNION ALL
    SELECT counter, key, span, win, count, first_seen, last_seen FROM tallyd.slots WHERE span <> 'all'
) AS parts
GROUP BY counter, key, span, win;

-- Retention: deletes up to batch_rows rows of `counter`'s `span` windows that start before
-- `before`, from tallyd.slots and tallyd.rollups; returns how many. Rows a flush holds are
-- skipped (SKIP LOCKED) and left to the next call, so it never waits on a flush.
CREATE FUNCTION tallyd.expire_windows(counter text, span text, before timestamptz,
                                      batch_rows int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    m bigint;
BEGIN
    WITH doomed AS (
        SELECT s.counter, s.key, s.span, s.win, s.slot FROM tallyd.slots s
        WHERE s.counter = expire_windows.counter AND s.span = expire_windows.span
          AND s.win < before
        LIMIT batch_rows
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM tallyd.slots s USING doomed d
    WHERE (s.counter, s.key, s.span, s.win, s.slot) = (d.counter, d.key, d.span, d.win, d.slot);
    GET DIAGNOSTICS n = ROW_COUNT;
    WITH doomed AS (
        SELECT r.counter, r.key, r.span, r.win FROM tallyd.rollups r
        WHERE r.counter = expire_windows.counter AND r.span = expire_windows.span
          AND r.win < before
        LIMIT batch_rows
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM tallyd.rollups r USING doomed d
    WHERE (r.counter, r.key, r.span, r.win) = (d.counter, d.key, d.span, d.win);
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END
$$;

-- The fold, per (counter, key, span, win): V7's text with the window columns.
DO $migration$
DECLARE
    -- %1$s, %2$s and %3$s stand for the slots, rollups and rollup_rejects relations; $1 is
    -- batch_rows and $2 the counters kept out of rollups (the rollup_into counters).

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
        -- The fold of one rollup step (migrations/V7, windows: V10) over the given relations.
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
        -- tallyd.rollup_fold over tallyd's own tables, as static statements (migrations/V7, V10).
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
