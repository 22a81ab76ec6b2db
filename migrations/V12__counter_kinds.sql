-- Counter kinds (docs/design.md, "Kinds"): besides sums, a counter keeps per key the distinct
-- values seen (unique: a postgresql-hll sketch), or the largest (max), smallest (min) or latest
-- by event time (last) 64-bit value. A row of tallyd.slots and tallyd.rollups says its kind
-- (`kind`, NULL for a sum, so every existing row stays a sum with no table rewrite); `count` is
-- the number of events for every kind but sum; `value` holds a max, min or last value and
-- `sketch` a unique counter's sketch in the hll type's own bytes (bytea here, so that tallyd's
-- tables need the extension only where a unique counter is declared: `sketch::hll` reads it).
--
-- Merging, in the flush's upsert (src/flush.rs), the fold below and the views: max and min by
-- greatest and least, last by the latest last_seen and, at equal times, the largest value, and
-- sketches by hll_union. Each is commutative, associative and idempotent, so the order in which
-- slot rows, flushes and rollup steps meet does not matter.

ALTER TABLE tallyd.slots
    ADD COLUMN kind text,
    ADD COLUMN value bigint,
    ADD COLUMN sketch bytea;
ALTER TABLE tallyd.rollups
    ADD COLUMN kind text,
    ADD COLUMN value bigint,
    ADD COLUMN sketch bytea;

-- What each counter was declared as when its rows were written (src/store/kinds.rs): a start
-- whose config changes a counter's kind or sketch parameters while rows of it remain is refused
-- (sketches of different parameters cannot be unioned; a max is not a sum).
CREATE TABLE tallyd.counter_kinds (
    counter  text PRIMARY KEY,
    kind     text NOT NULL,
    log2m    int,
    regwidth int
);

-- All-time totals, as V10, with each row's kind and value (max, min, last) at the end.
CREATE OR REPLACE VIEW tallyd.totals AS
SELECT counter, key,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count,
       coalesce(min(kind), 'sum') AS kind,
       CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
            WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                              FILTER (WHERE kind = 'last'))[1] END AS value
FROM (
    SELECT counter, key, count, first_seen, last_seen, kind, value FROM tallyd.rollups WHERE span = 'all'
    UNION ALL
    SELECT counter, key, count, first_seen, last_seen, kind, value FROM tallyd.slots WHERE span = 'all'
) AS parts
GROUP BY counter, key;

CREATE OR REPLACE VIEW tallyd.window_totals AS
SELECT counter, key, span, win AS window_start,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count,
       coalesce(min(kind), 'sum') AS kind,
       CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
            WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                              FILTER (WHERE kind = 'last'))[1] END AS value
FROM (
    SELECT counter, key, span, win, count, first_seen, last_seen, kind, value FROM tallyd.rollups WHERE span <> 'all'
    UNION ALL
    SELECT counter, key, span, win, count, first_seen, last_seen, kind, value FROM tallyd.slots WHERE span <> 'all'
) AS parts
GROUP BY counter, key, span, win;

-- The fold of unique counters' slot rows: up to batch_rows of them, claimed and key-locked as
-- every rollup step claims rows, deleted, and their sketches unioned (hll_union_agg) into
-- `rollups`. Dynamic statements, so that this function exists, and tallyd.rollup_fold calls it,
-- only where the hll extension is installed. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_sketches(slots regclass, rollups regclass, batch_rows int)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
BEGIN
    EXECUTE format($q$
        WITH claimed AS (
            SELECT s.counter, s.key, s.span, s.win, s.slot FROM %1$s s
            WHERE s.sketch IS NOT NULL
            LIMIT $1
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT * FROM claimed
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
        ), removed AS (
            DELETE FROM %1$s s
            USING owned o
            WHERE s.counter = o.counter AND s.key = o.key AND s.span = o.span
              AND s.win = o.win AND s.slot = o.slot
            RETURNING s.counter, s.key, s.span, s.win, s.count, s.first_seen, s.last_seen, s.sketch
        ), sums AS (
            SELECT counter, key, span, win, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
                   hll_union_agg(sketch::hll) AS sketch
            FROM removed GROUP BY counter, key, span, win
        ), added AS (
            INSERT INTO %2$s AS r (counter, key, span, win, count, first_seen, last_seen, kind, sketch)
            SELECT counter, key, span, win, count, first_seen, last_seen, 'unique',
                   decode(substr(sketch::text, 3), 'hex')
            FROM sums
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen),
                sketch = decode(substr(hll_union(r.sketch::hll, EXCLUDED.sketch::hll)::text, 3), 'hex')
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$, slots, rollups) INTO folded USING batch_rows;
    RETURN folded;
END
$$;

-- The fold, per (counter, key, span, win), with kinds: V11's text, unique rows left to
-- tallyd.rollup_sketches, and max, min and last values merged.
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
    -- The fold of every row but unique counters' (tallyd.rollup_sketches folds those); returns
    -- the slot rows folded.
    fold text := $q$
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.counter, s.key, s.span, s.win, s.slot, s.count, s.first_seen, s.last_seen FROM %1$s s
            WHERE s.counter || E'\n' || s.span <> ALL ($2)
              AND s.sketch IS NULL
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
            RETURNING s.counter, s.key, s.span, s.win, s.count, s.first_seen, s.last_seen,
                      s.kind, s.value
        ), sums AS (
            SELECT counter, key, span, win, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
                   min(kind) AS kind,
                   CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
                        WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                                          FILTER (WHERE kind = 'last'))[1] END AS value
            FROM removed GROUP BY counter, key, span, win
        ), added AS (
            INSERT INTO %2$s AS r (counter, key, span, win, count, first_seen, last_seen, kind, value)
            SELECT counter, key, span, win, count, first_seen, last_seen, kind, value FROM sums
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen),
                value = CASE r.kind
                    WHEN 'max' THEN GREATEST(r.value, EXCLUDED.value)
                    WHEN 'min' THEN LEAST(r.value, EXCLUDED.value)
                    WHEN 'last' THEN CASE WHEN EXCLUDED.last_seen > r.last_seen
                                            OR (EXCLUDED.last_seen = r.last_seen
                                                AND EXCLUDED.value > r.value)
                                          THEN EXCLUDED.value ELSE r.value END
                END
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$;
BEGIN
    EXECUTE format($f$
        -- The fold of one rollup step (migrations/V7, windows: V10, V11, kinds: V12) over the given relations.
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
            IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll') THEN
                folded := folded + tallyd.rollup_sketches(slots, rollups, batch_rows);
            END IF;
            RETURN folded;
        END
        $body$
    $f$, release, expire, fold);

    EXECUTE format($f$
        -- tallyd.rollup_fold over tallyd's own tables, as static statements (migrations/V7, V10, V11, V12).
        CREATE OR REPLACE FUNCTION tallyd.rollup_fold_own(batch_rows int, kept text[]) RETURNS bigint
        LANGUAGE plpgsql AS $body$
        DECLARE
            folded bigint;
        BEGIN
            %1$s;
            %2$s;
            %3$s
            INTO folded;
            IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll') THEN
                folded := folded + tallyd.rollup_sketches('tallyd.slots', 'tallyd.rollups', batch_rows);
            END IF;
            RETURN folded;
        END
        $body$
    $f$, format(release, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(expire, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(fold, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'));
END
$migration$;
