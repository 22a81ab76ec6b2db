-- tallyd.rollup_fold_own: last changed by migrations/V12__counter_kinds.sql (changed in V7, V10, V11, V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- tallyd.rollup_fold (functions/rollup_fold.sql, which describes the steps) over tallyd's own
-- tables, as static statements, whose plans PL/pgSQL keeps for the session: dynamic SQL alone
-- would plan them at every step (0.58 ms against 0.054 ms per step, docs/design.md, Rollup).
-- Installed from the same template as tallyd.rollup_fold. Four of the blank lines below hold
-- spaces: the template's, kept as the function's body holds them.
CREATE OR REPLACE FUNCTION tallyd.rollup_fold_own(batch_rows integer, kept text[])
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
        DECLARE
            folded bigint;
        BEGIN
            
        DELETE FROM tallyd.rollup_rejects j
        WHERE j.total IS NOT NULL
          AND NOT EXISTS (
              SELECT 1 FROM (
                  SELECT r.span, r.win, r.count FROM tallyd.rollups r WHERE r.counter = j.counter AND r.key = j.key
                  UNION ALL
                  SELECT s.span, s.win, s.count FROM tallyd.slots s WHERE s.counter = j.counter AND s.key = j.key
              ) p
              GROUP BY p.span, p.win
              HAVING sum(p.count) NOT BETWEEN -9223372036854775808 AND 9223372036854775807)
    ;
            
        DELETE FROM tallyd.rollup_rejects WHERE total IS NULL AND rejected_at < now() - interval '1 minute'
    ;
            
        WITH claimed AS (
            -- The claimed rows are locked: their values cannot change until this step commits.
            SELECT s.counter, s.key, s.span, s.win, s.slot, s.count, s.first_seen, s.last_seen FROM tallyd.slots s
            WHERE s.counter || E'\n' || s.span <> ALL ($2)
              AND s.sketch IS NULL
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j WHERE j.counter = s.counter AND j.key = s.key)
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
                   coalesce((SELECT r.count FROM tallyd.rollups r
                             WHERE r.counter = o.counter AND r.key = o.key
                               AND r.span = o.span AND r.win = o.win), 0) AS stored
            FROM owned o
        ), checked AS (
            SELECT counter, key, span, win, slot, added + stored AS total,
                   added BETWEEN -9223372036854775808 AND 9223372036854775807
                   AND added + stored BETWEEN -9223372036854775808 AND 9223372036854775807 AS fits
            FROM summed
        ), rejected AS (
            INSERT INTO tallyd.rollup_rejects AS j (counter, key, total)
            SELECT counter, key, max(total) FROM checked WHERE NOT fits GROUP BY counter, key
            ON CONFLICT (counter, key) DO UPDATE SET total = EXCLUDED.total, rejected_at = now()
        ), removed AS (
            DELETE FROM tallyd.slots s
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
            INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen, kind, value)
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
    
            INTO folded;
            IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll') THEN
                folded := folded + tallyd.rollup_sketches('tallyd.slots', 'tallyd.rollups', batch_rows,
                                                          kept);
            END IF;
            RETURN folded;
        END
        $function$
;
