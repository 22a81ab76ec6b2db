-- The rollup and tallyd.totals at the edge of the 64-bit range. A key whose folded total would
-- leave bigint must not fail the rollup step for every other key, and must not make a
-- whole-table read of tallyd.totals fail.

-- Keys the rollup did not fold because their folded total would leave the range of the column it
-- adds into. Their slot rows stay in tallyd.slots, so tallyd.totals stays exact. The rollup skips
-- these keys, retries them once their total fits again (summary counters) or after a minute
-- (rollup_into counters), and the daemon reports them as tallyd_rollup_overflow_keys.
CREATE TABLE tallyd.rollup_rejects (
    counter     text        NOT NULL,
    key         text        NOT NULL,
    -- The total the fold would have produced (NULL for rollup_into counters: the target
    -- column's type raised).
    total       numeric,
    rejected_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (counter, key)
);

-- `count` stays bigint for existing readers; it is NULL for the rare key whose exact total
-- leaves the bigint range, which `exact_count` (numeric) always holds.
CREATE OR REPLACE VIEW tallyd.totals AS
SELECT counter, key,
       CASE WHEN sum(count) BETWEEN -9223372036854775808 AND 9223372036854775807
            THEN sum(count)::bigint END AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen,
       sum(count)         AS exact_count
FROM (
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.rollups
    UNION ALL
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.slots
) AS parts
GROUP BY counter, key;

-- One rollup step, as in V2, with the range guard: a key whose fold would leave the range is
-- recorded in tallyd.rollup_rejects and its slot rows stay; every other key folds. The check
-- reads the summary row in the statement's snapshot; the fold adds to its latest version. If
-- another rollup folded the same key between the two (it held the key's lock until it
-- committed), the check can pass for a fold that then overflows: that step fails as before V4,
-- and the next one, with a fresh snapshot, holds the key back.
-- Returns the number of slot rows folded.
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
    n bigint;
    t record;
    k record;
BEGIN
    -- Summary keys held back earlier whose whole total fits again (a negative delta came).
    DELETE FROM tallyd.rollup_rejects j
    WHERE j.total IS NOT NULL
      AND (SELECT coalesce(sum(p.count), 0) FROM (
               SELECT r.count FROM tallyd.rollups r WHERE r.counter = j.counter AND r.key = j.key
               UNION ALL
               SELECT s.count FROM tallyd.slots s WHERE s.counter = j.counter AND s.key = j.key
           ) p) BETWEEN -9223372036854775808 AND 9223372036854775807;
    -- rollup_into keys are retried after a minute: the target column's type decides.
    DELETE FROM tallyd.rollup_rejects
    WHERE total IS NULL AND rejected_at < now() - interval '1 minute';

    WITH claimed AS (
        -- The claimed rows are locked: their values cannot change until this step commits.
        SELECT s.counter, s.key, s.slot, s.count, s.first_seen, s.last_seen FROM tallyd.slots s
        WHERE NOT EXISTS (SELECT 1 FROM tallyd.rollup_targets r WHERE r.counter = s.counter)
          AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                          WHERE j.counter = s.counter AND j.key = s.key)
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ), owned AS (
        -- Once per claimed row: a transaction that holds a key's lock gets it again at once,
        -- so all claimed rows of a key are kept or skipped together.
        SELECT * FROM claimed
        WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
    ), summed AS (
        -- Per claimed row, its key's claimed sum and the total it would fold to. Window and
        -- subquery, not joins between these CTEs: the plan stays linear in batch_rows.
        SELECT o.counter, o.key, o.slot, sum(o.count) OVER (PARTITION BY o.counter, o.key) AS added,
               coalesce((SELECT r.count FROM tallyd.rollups r
                         WHERE r.counter = o.counter AND r.key = o.key), 0) AS stored
        FROM owned o
    ), checked AS (
        SELECT counter, key, slot, added + stored AS total,
               added BETWEEN -9223372036854775808 AND 9223372036854775807
               AND added + stored BETWEEN -9223372036854775808 AND 9223372036854775807 AS fits
        FROM summed
    ), rejected AS (
        INSERT INTO tallyd.rollup_rejects AS j (counter, key, total)
        SELECT DISTINCT counter, key, total FROM checked WHERE NOT fits
        ON CONFLICT (counter, key) DO UPDATE SET total = EXCLUDED.total, rejected_at = now()
    ), removed AS (
        DELETE FROM tallyd.slots s
        USING checked c
        WHERE c.fits AND s.counter = c.counter AND s.key = c.key AND s.slot = c.slot
        RETURNING s.counter, s.key, s.count, s.first_seen, s.last_seen
    ), sums AS (
        SELECT counter, key, sum(count)::bigint AS count,
               min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n
        FROM removed GROUP BY counter, key
    ), added AS (
        INSERT INTO tallyd.rollups AS r (counter, key, count, first_seen, last_seen)
        SELECT counter, key, count, first_seen, last_seen FROM sums
        ON CONFLICT (counter, key) DO UPDATE SET
            count = r.count + EXCLUDED.count,
            first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
            last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)
    )
    SELECT coalesce(sum(sums.n), 0) INTO folded FROM sums;

    FOR t IN
        SELECT r.counter, r.target, r.key_column, r.count_column,
               format_type(a.atttypid, a.atttypmod) AS key_type
        FROM tallyd.rollup_targets r
        JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
        WHERE EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = r.counter)
    LOOP
        BEGIN
            n := tallyd.rollup_into_step(t.counter, t.target, t.key_column, t.count_column,
                                         t.key_type, batch_rows, NULL);
        EXCEPTION WHEN numeric_value_out_of_range THEN
            -- Some key's column would leave its type's range: fold key by key, each in its own
            -- subtransaction, and hold back only the keys that fail. The keys are the ones
            -- rollup_into_step can claim (a row in the target table): keys without one are
            -- never folded, and batch_rows of them must not fill the window. In key order, so
            -- that successive steps page through the keys as their rows fold away.
            n := 0;
            FOR k IN EXECUTE format($keys$
                SELECT DISTINCT s.key FROM tallyd.slots s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                                  WHERE j.counter = s.counter AND j.key = s.key)
                  AND EXISTS (SELECT 1 FROM %1$s u WHERE u.%2$I = s.key::%3$s)
                ORDER BY s.key
                LIMIT $2
            $keys$, t.target, t.key_column, t.key_type) USING t.counter, batch_rows
            LOOP
                BEGIN
                    n := n + tallyd.rollup_into_step(t.counter, t.target, t.key_column,
                                                     t.count_column, t.key_type, batch_rows, k.key);
                EXCEPTION WHEN numeric_value_out_of_range THEN
                    INSERT INTO tallyd.rollup_rejects AS j (counter, key, total)
                    VALUES (t.counter, k.key, NULL)
                    ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now();
                END;
            END LOOP;
        END;
        folded := folded + n;
    END LOOP;
    RETURN folded;
END
$$;

-- The rollup_into part of one step for one counter (as in V2), optionally for one key only.
-- Raises numeric_value_out_of_range when a key's column would leave its type's range.
CREATE FUNCTION tallyd.rollup_into_step(counter text, target regclass, key_column name,
                                        count_column name, key_type text, batch_rows int,
                                        only_key text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    EXECUTE format($step$
        WITH claimed AS (
            SELECT s.key, s.slot FROM tallyd.slots s
            WHERE s.counter = $1
              AND ($3::text IS NULL OR s.key = $3)
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
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
            DELETE FROM tallyd.slots s USING folding f
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
    $step$, target, key_column, count_column, key_type)
    INTO n USING counter, batch_rows, only_key;
    RETURN n;
END
$$;
