-- tallyd.rollup_summary: last changed by migrations/V22__rollup_without_hll.sql (changed in V14, V17, V19, V22)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One step of a counter's rows bound for tallyd.rollups (every span but its rollup_into target's,
-- if it has one), after the key `after_key` ('' starts a pass; the daemon keeps the cursor): up to
-- batch_rows rows claimed in key order (FOR UPDATE SKIP LOCKED, an index range from the cursor),
-- each with its summary row found by one index probe; the rows without one are deleted, summed and
-- inserted first, in the flush's order (key bytes, span rank, window); then the existing summary
-- rows are locked unless another transaction holds them (FOR NO KEY UPDATE SKIP LOCKED: those rows
-- stay for a later pass) and added to. No per-key advisory lock (corrections take SHARE ROW
-- EXCLUSIVE on tallyd.slots). A total beyond 64 bits raises in that fast path, which rolls back to
-- its savepoint and runs V12's guarded fold over the same range instead (tallyd.rollup_rejects).
-- At a pass's start, the counter's keys held back whose every window fits again are released.
-- Returns the slot rows folded, the rows claimed, and the last key claimed when the batch was full
-- (NULL: the pass ended). A unique counter's sketches fold by rollup_summary_sketches.
-- Every statement it runs (and those of the functions it calls) is planned for its arguments
-- (V17): a cached generic plan of the claim read and sorted every slot row of the counter. The
-- claim is planned with sorts disabled (V19): a plan for the arguments on stale statistics sorted
-- every slot row too; the ordered index range from the cursor reads only the batch.
CREATE OR REPLACE FUNCTION tallyd.rollup_summary(counter_name text, counter_kind text, after_key text, batch_rows integer, OUT folded bigint, OUT claimed bigint, OUT last_key text)
 RETURNS record
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET plan_cache_mode TO 'force_custom_plan'
 SET enable_sort TO 'on'
AS $function$
DECLARE
    except_span text := (SELECT t.span FROM tallyd.rollup_targets t WHERE t.counter = counter_name);
    tids tid[];
    keys text[];
    rtids tid[];
    n bigint;
BEGIN
    -- The lock every writer of tallyd.slots holds, taken before any row is claimed: a claimed
    -- row's DELETE needs it, and a correction (tallyd.correct's SHARE ROW EXCLUSIVE, held while
    -- it waits for a row this step claimed) would otherwise deadlock with it.
    LOCK TABLE tallyd.slots IN ROW EXCLUSIVE MODE;
    folded := 0;
    IF after_key = '' THEN
        -- A new pass: the counter's keys held back beyond 64 bits whose every window's total
        -- fits again are released (V5; a key is held back whole, all its windows with it).
        DELETE FROM tallyd.rollup_rejects j
        WHERE j.counter = counter_name AND j.total IS NOT NULL
          AND NOT EXISTS (
              SELECT 1 FROM (
                  SELECT r.span, r.win, r.count FROM tallyd.rollups r WHERE r.counter = j.counter AND r.key = j.key
                  UNION ALL
                  SELECT s.span, s.win, s.count FROM tallyd.slots s WHERE s.counter = j.counter AND s.key = j.key
              ) p
              GROUP BY p.span, p.win
              HAVING sum(p.count) NOT BETWEEN -9223372036854775808 AND 9223372036854775807);
    END IF;
    IF counter_kind = 'unique' THEN
        -- Without the hll extension (DROP EXTENSION hll CASCADE) no sketch can be folded: the
        -- counter's rows wait in tallyd.slots (the flush reports the missing extension), and the
        -- step ends its pass at once, so that tallyd.rollup() folds every other counter (V22;
        -- before, the whole call failed on the missing type).
        IF NOT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll') THEN
            claimed := 0;
            RETURN;
        END IF;
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_summary_sketches(counter_name, except_span, after_key, batch_rows) x;
        RETURN;
    END IF;
    BEGIN
        -- 1. Claim, and find each claimed row's summary row (NULL: none yet). Planned with sorts
        -- disabled (V19), so that the batch is the ordered index range from the cursor whatever
        -- the statistics say; the function's own SET restores the setting at its exit.
        PERFORM set_config('enable_sort', 'off', true);
        SELECT array_agg(c.tid), array_agg(c.key), array_agg(c.rtid), count(*), max(c.key)
        INTO tids, keys, rtids, claimed, last_key
        FROM (
            SELECT s.ctid AS tid, s.key, r.rtid
            FROM tallyd.slots s
            LEFT JOIN LATERAL (
                SELECT r.ctid AS rtid FROM tallyd.rollups r
                WHERE r.counter = s.counter AND r.key = s.key AND r.span = s.span AND r.win = s.win
                LIMIT 1) r ON true
            WHERE s.counter = counter_name AND s.key > after_key
              AND s.span IS DISTINCT FROM except_span AND s.sketch IS NULL
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
            ORDER BY s.key
            LIMIT batch_rows
            FOR UPDATE OF s SKIP LOCKED
        ) c;
        PERFORM set_config('enable_sort', 'on', true);
        IF claimed = 0 THEN
            last_key := NULL;
            RETURN;
        END IF;
        -- 2. The rows without a summary row: deleted, summed, and inserted in the flush's order.
        -- A row another transaction inserted meanwhile is found by the conflict and added to.
        WITH removed AS (
            DELETE FROM tallyd.slots s
            USING unnest(tids, keys, rtids) AS x (t, k, r)
            WHERE x.r IS NULL AND s.ctid = x.t AND s.key = x.k
            RETURNING s.key, s.span, s.win, s.count, s.first_seen, s.last_seen, s.kind, s.value
        ), sums AS (
            SELECT key, span, win, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
                   min(kind) AS kind,
                   CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
                        WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                                          FILTER (WHERE kind = 'last'))[1] END AS value
            FROM removed GROUP BY key, span, win
        ), added AS (
            INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen, kind, value)
            SELECT counter_name, key, span, win, count, first_seen, last_seen, kind, value FROM sums
            ORDER BY key COLLATE "C", tallyd.span_rank(span), win
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
        SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
        folded := folded + n;
        -- 3. The rows whose summary row exists: that row locked unless another transaction
        -- holds it (then they stay for a later pass), checked to be the same row (its ctid was
        -- read by an earlier statement), and added to.
        WITH x AS (
            SELECT x.t, x.k, x.r FROM unnest(tids, keys, rtids) AS x (t, k, r) WHERE x.r IS NOT NULL
        ), locked AS MATERIALIZED (
            SELECT r.ctid AS rtid, r.key, r.span, r.win FROM tallyd.rollups r
            WHERE r.ctid = ANY (ARRAY(SELECT x.r FROM x)) AND r.counter = counter_name
            FOR NO KEY UPDATE OF r SKIP LOCKED
        ), removed AS (
            DELETE FROM tallyd.slots s
            USING x JOIN locked l ON l.rtid = x.r
            WHERE s.ctid = x.t AND s.key = x.k AND s.key = l.key AND s.span = l.span AND s.win = l.win
            RETURNING l.rtid, s.count, s.first_seen, s.last_seen, s.kind, s.value
        ), sums AS (
            SELECT rtid, sum(count)::bigint AS count,
                   min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
                   CASE min(kind) WHEN 'max' THEN max(value) WHEN 'min' THEN min(value)
                        WHEN 'last' THEN (array_agg(value ORDER BY last_seen DESC, value DESC)
                                          FILTER (WHERE kind = 'last'))[1] END AS value
            FROM removed GROUP BY rtid
        ), updated AS (
            UPDATE tallyd.rollups r SET
                count = r.count + sums.count,
                first_seen = LEAST(r.first_seen, sums.first_seen),
                last_seen = GREATEST(r.last_seen, sums.last_seen),
                value = CASE r.kind
                    WHEN 'max' THEN GREATEST(r.value, sums.value)
                    WHEN 'min' THEN LEAST(r.value, sums.value)
                    WHEN 'last' THEN CASE WHEN sums.last_seen > r.last_seen
                                            OR (sums.last_seen = r.last_seen
                                                AND sums.value > r.value)
                                          THEN sums.value ELSE r.value END
                END
            FROM sums WHERE r.ctid = sums.rtid
        )
        SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
        folded := folded + n;
    EXCEPTION WHEN numeric_value_out_of_range THEN
        -- A total would leave the 64-bit range: this step's fast path rolled back, and V12's
        -- guarded fold runs over the same range instead, holding back only the keys that do not
        -- fit (tallyd.rollup_rejects, with their total). It keeps V5's advisory lock per key.
        folded := 0;
        WITH batch AS (
            SELECT s.counter, s.key, s.span, s.win, s.slot, s.count, s.first_seen, s.last_seen
            FROM tallyd.slots s
            WHERE s.counter = counter_name AND s.key > after_key
              AND s.span IS DISTINCT FROM except_span AND s.sketch IS NULL
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key)
            ORDER BY s.key
            LIMIT batch_rows
            FOR UPDATE OF s SKIP LOCKED
        ), owned AS (
            SELECT * FROM batch
            WHERE pg_try_advisory_xact_lock(1952541816, hashtext(counter || E'\n' || key))
        ), summed AS (
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
            ORDER BY key COLLATE "C", tallyd.span_rank(span), win
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
        SELECT coalesce((SELECT sum(sums.n) FROM sums), 0), (SELECT count(*) FROM batch),
               (SELECT max(batch.key) FROM batch)
        INTO folded, claimed, last_key;
    END;
    IF claimed < batch_rows THEN
        last_key := NULL;
    END IF;
END
$function$;
