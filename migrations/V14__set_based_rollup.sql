-- The rollup at the flush's speed (issue 32; docs/design.md, "Rollup"). V13's step cost in
-- proportion to the tables, not to the step: tallyd.rollup_fold_own read all of tallyd.slots at
-- every step (its claim, `counter || span <> ALL (kept)`, had no index condition), the windowed
-- insert_missing statement hashed the whole target table at every step (`NOT EXISTS` planned as
-- a hashed SubPlan), every claim restarted at the table's first row, behind every row earlier
-- steps had deleted (dead, and unprunable while a flush's transaction held the horizon back), the
-- targets' statements were dynamic SQL planned at every step, and a per-key advisory lock per
-- claimed row capped a step at the lock table's size (about 6,400 keys).
--
-- This migration adds a step per *unit* (one counter's rows bound for tallyd.rollups, or its rows
-- bound for its rollup_into target), which the daemon's scheduler calls with a key cursor it
-- keeps per unit (src/rollup/), and rewrites tallyd.rollup() (the CLI's and pg_cron's entry
-- point, same signature and meaning) on top of it. Each step:
--
-- - claims in key order after the cursor (`counter = $1 AND key > $after_key ORDER BY key LIMIT n
--   FOR UPDATE SKIP LOCKED`): an index range, so it reads the rows it claims, not the rows before
--   them; a step that claims fewer than n rows ended a pass, and the next starts at '' again;
-- - probes every row's summary or target row with `LEFT JOIN LATERAL (... LIMIT 1)`: one index
--   probe per claimed row whatever the statistics say (the step functions are declared
--   `SET enable_seqscan = off`, so that a plan cached while a table looked empty cannot scan);
-- - inserts the missing summary or target rows first, in the order the flush writes rows (key
--   bytes, then the span's rank, then the window), and only then locks the existing ones with
--   FOR NO KEY UPDATE SKIP LOCKED and adds to them: a step waits only for another transaction's
--   insert of a new row, never on an existing row (a row the application, a flush or another step
--   holds stays in slots for a later pass), and everything that waits on a new row inserts in
--   that one order, so no cycle of waits can form (docs/design.md, "Rollup");
-- - takes no per-key advisory lock: corrections take SHARE ROW EXCLUSIVE on tallyd.slots, which
--   every step's DELETE conflicts with from its start, and sums commute; the guarded fallback
--   below keeps V5's lock;
-- - runs static statements, whose plans PL/pgSQL keeps for the session: the summary's here, each
--   target's generated once per target when tallyd records the targets
--   (tallyd.install_rollup_targets, called by src/store/targets.rs and below).
--
-- What V5, V11 and V12 hold back is held back exactly as before: a summary total beyond 64 bits
-- raises in the fast path, which rolls back to a savepoint and runs V12's guarded fold over the
-- same cursor range (keys recorded in tallyd.rollup_rejects with their total); a target column
-- beyond its type's range, or a foreign key refusing an inserted row, makes the target's step
-- fold the batch's keys one by one, holding back only the failing ones (tallyd.rollup_rejects,
-- tallyd.rollup_held with its retry schedule).
--
-- On Citus (tallyd.slots distributed) tallyd.rollup() still calls tallyd.rollup_citus, which steps
-- each shard group with V13's functions; V6 to V13's functions stay for that.

-- The span's rank as the flush sorts a key's rows (src/window.rs, SpanCode: all, minute, hour,
-- day, week, month), so that a step inserts new tallyd.rollups rows in the flush's order.
CREATE FUNCTION tallyd.span_rank(span text)
RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT array_position(ARRAY['all', 'minute', 'hour', 'day', 'week', 'month'], span)
$$;

-- Which counters have slot rows, and their kind (a counter's rows are all of one kind): one index
-- descent per counter (a loose index scan), not a read of the table.
CREATE FUNCTION tallyd.rollup_counters()
RETURNS TABLE (counter text, kind text)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE found AS (
        (SELECT s.counter, s.kind FROM tallyd.slots s ORDER BY s.counter LIMIT 1)
        UNION ALL
        SELECT n.counter, n.kind FROM found f
        CROSS JOIN LATERAL (SELECT s.counter, s.kind FROM tallyd.slots s
                            WHERE s.counter > f.counter ORDER BY s.counter LIMIT 1) n
    )
    SELECT found.counter, coalesce(found.kind, 'sum') FROM found
$$;

-- One step of a counter's rows bound for tallyd.rollups (every span but its rollup_into target's,
-- if it has one), after the key `after_key` ('' starts a pass): up to batch_rows rows claimed in key
-- order, folded as described above. Returns the slot rows folded, the rows claimed, and the last
-- key claimed when the step claimed a full batch (NULL: the pass ended). `counter_kind` is the
-- counter's kind: a unique counter's sketches fold by tallyd.rollup_summary_sketches.
CREATE FUNCTION tallyd.rollup_summary(counter_name text, counter_kind text, after_key text, batch_rows integer,
                                      OUT folded bigint, OUT claimed bigint, OUT last_key text)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
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
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_summary_sketches(counter_name, except_span, after_key, batch_rows) x;
        RETURN;
    END IF;
    BEGIN
        -- 1. Claim, and find each claimed row's summary row (NULL: none yet).
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
$$;

-- tallyd.rollup_summary for a unique counter: its sketches claimed, probed and folded the same
-- way, unioned by the hll extension (hll_union_agg, hll_union), which exists wherever a unique
-- counter is declared (src/store/kinds.rs). PL/pgSQL resolves those names only when a statement
-- first runs, so this function exists everywhere.
CREATE FUNCTION tallyd.rollup_summary_sketches(counter_name text, except_span text, after_key text, batch_rows integer,
                                               OUT folded bigint, OUT claimed bigint, OUT last_key text)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    tids tid[];
    keys text[];
    rtids tid[];
    n bigint;
BEGIN
    folded := 0;
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
          AND s.span IS DISTINCT FROM except_span AND s.sketch IS NOT NULL
        ORDER BY s.key
        LIMIT batch_rows
        FOR UPDATE OF s SKIP LOCKED
    ) c;
    IF claimed < batch_rows THEN
        last_key := NULL;
    END IF;
    IF claimed = 0 THEN
        RETURN;
    END IF;
    WITH removed AS (
        DELETE FROM tallyd.slots s
        USING unnest(tids, keys, rtids) AS x (t, k, r)
        WHERE x.r IS NULL AND s.ctid = x.t AND s.key = x.k
        RETURNING s.key, s.span, s.win, s.count, s.first_seen, s.last_seen, s.sketch
    ), sums AS (
        SELECT key, span, win, sum(count)::bigint AS count,
               min(first_seen) AS first_seen, max(last_seen) AS last_seen, count(*) AS n,
               hll_union_agg(sketch::hll) AS sketch
        FROM removed GROUP BY key, span, win
    ), added AS (
        INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen, kind, sketch)
        SELECT counter_name, key, span, win, count, first_seen, last_seen, 'unique', hll_send(sketch)
        FROM sums
        ORDER BY key COLLATE "C", tallyd.span_rank(span), win
        ON CONFLICT (counter, key, span, win) DO UPDATE SET
            count = r.count + EXCLUDED.count,
            first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
            last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen),
            sketch = hll_send(hll_union(r.sketch::hll, EXCLUDED.sketch::hll))
    )
    SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
    folded := folded + n;
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
        RETURNING l.rtid, s.count, s.first_seen, s.last_seen, s.sketch
    ), sums AS (
        SELECT rtid, sum(count)::bigint AS count, min(first_seen) AS first_seen,
               max(last_seen) AS last_seen, count(*) AS n, hll_union_agg(sketch::hll) AS sketch
        FROM removed GROUP BY rtid
    ), updated AS (
        UPDATE tallyd.rollups r SET
            count = r.count + sums.count,
            first_seen = LEAST(r.first_seen, sums.first_seen),
            last_seen = GREATEST(r.last_seen, sums.last_seen),
            sketch = hll_send(hll_union(r.sketch::hll, sums.sketch))
        FROM sums WHERE r.ctid = sums.rtid
    )
    SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
    folded := folded + n;
END
$$;

-- The text of the step function of one rollup_into target (an element of
-- tallyd.rollup_targets_json()), `tallyd.rollup_into_step_<md5 of the counter>(after_key, batch_rows,
-- only_key)`: the statements of tallyd.rollup_summary with the target's table, columns, key type,
-- window value and kind written in, so that they are static and PL/pgSQL keeps their plans. With
-- `only_key` it folds that key's rows only (the key-by-key fallback of tallyd.rollup_target),
-- raising what fails; else the batch after `after_key`, leaving out keys held back
-- (tallyd.rollup_rejects, tallyd.rollup_held), and if a key's column would leave its type's range
-- or an inserted row's parent is missing, it writes nothing and returns the batch's keys
-- (`failed_keys`) for the caller to fold one by one. A sum adds its count to the column; a max, min or unique counter merges its
-- value (greatest, least, hll union). Without insert_missing only rows whose target row exists
-- are claimed (a key without one is reported by tallyd.unmatched()); with it, the missing rows are
-- inserted first, in the flush's order.
CREATE FUNCTION tallyd.rollup_target_function(target jsonb)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    counter_name text := target ->> 'counter';
    counter_kind text := coalesce(target ->> 'kind', 'sum');
    windowed boolean := coalesce(target ->> 'span', 'all') <> 'all';
    insert_missing boolean := windowed AND coalesce((target ->> 'insert_missing')::boolean, false);
    window_type text := target ->> 'window_type';
    zone text := target ->> 'time_zone';
    -- Substituted last, by format(): %1$s the table (with its schema), %2$I its key column, %3$I its count (or
    -- value) column, %4$s the key column's type, %5$I the window column, %6$s and %7$s the window
    -- value of the slot row aliased s and r, %8$L the counter, %9$L its span, %10$I the
    -- function's name.
    args text[] := ARRAY[(SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c
                          JOIN pg_namespace n ON n.oid = c.relnamespace
                          WHERE c.oid = (target ->> 'target')::regclass), target ->> 'key_column',
                         target ->> 'count_column', target ->> 'key_type', target ->> 'window_column',
                         CASE WHEN windowed THEN tallyd.window_value('s', window_type, zone) END,
                         CASE WHEN windowed THEN tallyd.window_value('r', window_type, zone) END,
                         counter_name, coalesce(target ->> 'span', 'all'),
                         'rollup_into_step_' || md5(counter_name)];
    body text := $body$
    CREATE OR REPLACE FUNCTION tallyd.%10$I(after_key text, batch_rows integer, only_key text,
                                           OUT folded bigint, OUT claimed bigint, OUT last_key text,
                                           OUT failed_keys text[])
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $f$
-- Generated by tallyd.rollup_target_function (migrations/V14) for counter %8$L: tallyd
-- generates it again whenever it records the rollup_into targets (tallyd.install_rollup_targets).
DECLARE
    tids tid[];
    keys text[];
    utids tid[];
    n bigint;
BEGIN
    folded := 0;
    IF only_key IS NULL THEN
        {claim_batch}
    ELSE
        {claim_key}
    END IF;
    IF claimed < batch_rows THEN
        last_key := NULL;
    END IF;
    IF claimed = 0 THEN
        RETURN;
    END IF;
    BEGIN{missing}
    -- The rows whose target row exists: that row locked unless another transaction holds it
    -- (then they stay for a later pass), checked to be the same row (its ctid was read by an
    -- earlier statement), and added to (or merged with).
    WITH x AS (
        SELECT x.t, x.k, x.u FROM unnest(tids, keys, utids) AS x (t, k, u) WHERE x.u IS NOT NULL
    ), locked AS MATERIALIZED (
        SELECT u.ctid AS utid, u.%2$I AS k{locked_window} FROM %1$s u
        WHERE u.ctid = ANY (ARRAY(SELECT x.u FROM x))
        FOR NO KEY UPDATE OF u SKIP LOCKED
    ), removed AS (
        DELETE FROM tallyd.slots s
        USING x JOIN locked l ON l.utid = x.u
        WHERE s.ctid = x.t AND s.key = x.k AND {same}
        RETURNING l.utid, {value} AS v
    ), sums AS (
        SELECT utid, {agg} AS v, count(*) AS n FROM removed GROUP BY utid
    ), written AS (
        UPDATE %1$s u SET %3$I = {merged} FROM sums WHERE u.ctid = sums.utid
    )
    SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
    folded := folded + n;
    EXCEPTION WHEN numeric_value_out_of_range OR foreign_key_violation THEN
        -- A key's column would leave its type's range, or an inserted row's parent is missing:
        -- nothing of the batch is written (the claims stay), and the caller folds the batch's
        -- keys one by one (one key's failure is the caller's to hold back).
        IF only_key IS NOT NULL THEN
            RAISE;
        END IF;
        folded := 0;
        failed_keys := ARRAY(SELECT DISTINCT k FROM unnest(keys) AS k ORDER BY k);
    END;
END
$f$
$body$;
    claim text := $claim$-- Claim in key order, with each row's target row (a probe of its index).
        SELECT array_agg(c.tid), array_agg(c.key), array_agg(c.utid), count(*), max(c.key)
        INTO tids, keys, utids, claimed, last_key
        FROM (
            SELECT s.ctid AS tid, s.key, u.utid
            FROM tallyd.slots s
            {join} LATERAL (SELECT u.ctid AS utid FROM %1$s u WHERE {probe} LIMIT 1) u ON true
            WHERE s.counter = %8$L AND s.span = %9$L AND {filter}
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_rejects j
                              WHERE j.counter = s.counter AND j.key = s.key){order}
            LIMIT batch_rows
            FOR UPDATE OF s SKIP LOCKED
        ) c;$claim$;
    missing text := $missing$
    -- The rows without a target row: deleted, summed per target row (keys that cast alike share
    -- one) and inserted in the flush's order; a row inserted meanwhile is found by the conflict.
    WITH removed AS (
        DELETE FROM tallyd.slots s
        USING unnest(tids, keys, utids) AS x (t, k, u)
        WHERE x.u IS NULL AND s.ctid = x.t AND s.key = x.k
        RETURNING s.key, s.win, s.count
    ), sums AS (
        SELECT r.key::%4$s AS k, %7$s AS w, min(r.key COLLATE "C") AS o,
               sum(r.count)::bigint AS v, count(*) AS n
        FROM removed r GROUP BY 1, 2
    ), written AS (
        INSERT INTO %1$s AS u (%2$I, %5$I, %3$I)
        SELECT k, w, v FROM sums ORDER BY o, w
        ON CONFLICT (%2$I, %5$I) DO UPDATE SET %3$I = coalesce(u.%3$I, 0) + EXCLUDED.%3$I
    )
    SELECT coalesce(sum(sums.n), 0) INTO n FROM sums;
    folded := folded + n;$missing$;
    probe text := CASE WHEN windowed THEN 'u.%2$I = s.key::%4$s AND u.%5$I = %6$s'
                       ELSE 'u.%2$I = s.key::%4$s' END;
BEGIN
    IF counter_kind NOT IN ('sum', 'max', 'min', 'unique') THEN
        RAISE EXCEPTION 'tallyd.rollup_target_function: kind % cannot fold into a column', counter_kind;
    END IF;
    claim := replace(replace(claim, '{join}', CASE WHEN insert_missing THEN 'LEFT JOIN' ELSE 'JOIN' END),
                     '{probe}', probe);
    body := replace(body, '{claim_batch}', replace(replace(claim,
        '{filter}', 's.key > after_key
              AND NOT EXISTS (SELECT 1 FROM tallyd.rollup_held h
                              WHERE h.counter = s.counter AND h.key = s.key)'),
        '{order}', E'\n            ORDER BY s.key'));
    body := replace(body, '{claim_key}', replace(replace(claim, '{filter}', 's.key = only_key'),
                                                 '{order}', ''));
    body := replace(body, '{missing}', CASE WHEN insert_missing THEN missing ELSE '' END);
    body := replace(body, '{locked_window}', CASE WHEN windowed THEN ', u.%5$I AS w' ELSE '' END);
    body := replace(body, '{same}', CASE WHEN windowed THEN 'l.k = s.key::%4$s AND l.w = %6$s'
                                         ELSE 'l.k = s.key::%4$s' END);
    body := replace(body, '{value}', CASE counter_kind WHEN 'sum' THEN 's.count'
                                                       WHEN 'unique' THEN 's.sketch' ELSE 's.value' END);
    body := replace(body, '{agg}', CASE counter_kind WHEN 'sum' THEN 'sum(v)::bigint'
                                       WHEN 'max' THEN 'max(v)' WHEN 'min' THEN 'min(v)'
                                       WHEN 'unique' THEN 'hll_union_agg(v::hll)' END);
    body := replace(body, '{merged}', CASE counter_kind
        WHEN 'sum' THEN 'coalesce(u.%3$I, 0) + sums.v'
        WHEN 'max' THEN 'GREATEST(u.%3$I, sums.v)'
        WHEN 'min' THEN 'LEAST(u.%3$I, sums.v)'
        WHEN 'unique' THEN 'CASE WHEN u.%3$I IS NULL THEN sums.v ELSE hll_union(u.%3$I, sums.v) END' END);
    RETURN format(body, VARIADIC args);
END
$$;

-- (Re)generates the step function of every recorded rollup_into target and drops those of
-- targets no longer recorded; tallyd calls it in the transaction that records the targets
-- (src/store/targets.rs). A target whose table or columns do not exist gets none, and folds
-- nothing until a start records it again (its rows stay in tallyd.slots, out of tallyd.rollups,
-- as V11 left them). Not on Citus: tallyd.rollup_citus folds each shard group with V13's
-- functions.
CREATE FUNCTION tallyd.install_rollup_targets()
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    t jsonb;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure AS sig FROM pg_proc p
        WHERE p.pronamespace = 'tallyd'::regnamespace AND p.proname LIKE 'rollup\_into\_step\_%'
    LOOP
        EXECUTE format('DROP FUNCTION %s', f.sig);
    END LOOP;
    IF tallyd.is_distributed('tallyd.slots') THEN
        RETURN;
    END IF;
    FOR t IN SELECT x FROM jsonb_array_elements(tallyd.rollup_targets_json()) x
             WHERE x ->> 'target' IS NOT NULL
    LOOP
        EXECUTE tallyd.rollup_target_function(t);
    END LOOP;
END
$$;
SELECT tallyd.install_rollup_targets();

-- One step of a counter's rows bound for its rollup_into target, after the key `after_key`: keys
-- held back by a foreign key whose retry is due first, each on its own (V11), then the batch
-- (the target's generated step function); if the batch fails because a key's column would leave
-- its type's range or an inserted row's parent is missing (the step function then writes nothing
-- and returns the batch's keys), those keys one by one, in key order, each in its own
-- subtransaction, holding back only those that fail
-- (tallyd.rollup_rejects, retried after a minute, or tallyd.rollup_held, retried 1 s later, then
-- 2, 4, ... up to 60 s). A target without a step function (its table or a column was missing
-- at the last start) folds nothing. Returns as tallyd.rollup_summary does.
CREATE FUNCTION tallyd.rollup_target(counter_name text, after_key text, batch_rows integer,
                                     OUT folded bigint, OUT claimed bigint, OUT last_key text)
LANGUAGE plpgsql AS $$
DECLARE
    step text := 'tallyd.' || quote_ident('rollup_into_step_' || md5(counter_name));
    t record;
    n bigint;
    failed text[];
    k record;
BEGIN
    -- The lock every writer of tallyd.slots holds, taken before any row is claimed: a claimed
    -- row's DELETE needs it, and a correction (tallyd.correct's SHARE ROW EXCLUSIVE, held while
    -- it waits for a row this step claimed) would otherwise deadlock with it.
    LOCK TABLE tallyd.slots IN ROW EXCLUSIVE MODE;
    folded := 0;
    claimed := 0;
    SELECT r.span, r.insert_missing INTO t FROM tallyd.rollup_targets r WHERE r.counter = counter_name;
    IF NOT FOUND OR to_regprocedure(step || '(text,integer,text)') IS NULL THEN
        RETURN;
    END IF;
    IF after_key = '' THEN
        -- A new pass: keys whose column would have left its type's range are tried again.
        DELETE FROM tallyd.rollup_rejects j
        WHERE j.counter = counter_name AND j.total IS NULL AND j.rejected_at < now() - interval '1 minute';
    END IF;
    IF t.insert_missing THEN
        FOR k IN
            SELECT h.key FROM tallyd.rollup_held h
            WHERE h.counter = counter_name AND h.retry_at <= now()
            ORDER BY h.retry_at, h.key
            LIMIT batch_rows
        LOOP
            BEGIN
                EXECUTE format('SELECT x.folded FROM %s($1, $2, $3) x', step)
                    INTO n USING '', batch_rows, k.key;
                folded := folded + n;
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
    END IF;
    EXECUTE format('SELECT x.folded, x.claimed, x.last_key, x.failed_keys FROM %s($1, $2, NULL) x', step)
        INTO n, claimed, last_key, failed USING after_key, batch_rows;
    folded := folded + n;
    -- The batch failed (a key's column would leave its type's range, or an inserted row's
    -- parent is missing): its keys one by one, each in its own subtransaction, holding back only
    -- those that fail.
    FOR k IN SELECT x AS key FROM unnest(failed) AS x LOOP
        BEGIN
            EXECUTE format('SELECT x.folded FROM %s($1, $2, $3) x', step)
                INTO n USING '', batch_rows, k.key;
            folded := folded + n;
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
END
$$;

-- One step of one unit, as the daemon's scheduler and `tallyd rollup` call it (src/rollup/): a
-- counter's rows bound for its rollup_into target (`into_target`) or for tallyd.rollups, after the
-- key `after_key` ('' starts a pass), at most batch_rows rows. Commits without waiting for the WAL to
-- reach the disk (synchronous_commit off, for this transaction only): a crash may lose the last
-- steps, and WAL replays in order, so a lost step leaves its rows in tallyd.slots and its target
-- unchanged, still counted once (docs/design.md, "Rollup"). Call it in a transaction of its own.
CREATE FUNCTION tallyd.rollup_step(counter_name text, counter_kind text, into_target boolean, after_key text,
                                   batch_rows integer,
                                   OUT folded bigint, OUT claimed bigint, OUT last_key text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF into_target THEN
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_target(counter_name, after_key, batch_rows) x;
    ELSE
        SELECT x.folded, x.claimed, x.last_key INTO folded, claimed, last_key
        FROM tallyd.rollup_summary(counter_name, counter_kind, after_key, batch_rows) x;
    END IF;
END
$$;

-- One rollup step, as pg_cron and anyone calling SQL run it; returns the slot rows folded. On a
-- Citus cluster whose tallyd.slots is distributed, one step per shard group on its worker
-- (tallyd.rollup_citus, as V6 to V13). Otherwise, for every counter with slot rows
-- (tallyd.rollup_counters), from its first key: up to batch_rows rows of all counters together
-- bound for tallyd.rollups (tallyd.rollup_summary), and up to batch_rows rows of each rollup_into
-- target (tallyd.rollup_target). The daemon steps each unit with a cursor instead
-- (tallyd.rollup_step).
CREATE OR REPLACE FUNCTION tallyd.rollup(batch_rows integer DEFAULT 1000)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    c record;
    s record;
    target_span text;
    folded bigint := 0;
    remaining bigint := batch_rows;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF tallyd.is_distributed('tallyd.slots') THEN
            RETURN tallyd.rollup_citus(batch_rows);
        END IF;
    END IF;
    FOR c IN SELECT * FROM tallyd.rollup_counters() LOOP
        target_span := (SELECT t.span FROM tallyd.rollup_targets t WHERE t.counter = c.counter);
        -- An all-time target takes all of its counter's rows; a windowed one its window's.
        IF target_span IS DISTINCT FROM 'all' AND remaining > 0 THEN
            SELECT * INTO s FROM tallyd.rollup_summary(c.counter, c.kind, '', remaining::integer);
            folded := folded + s.folded;
            remaining := remaining - s.claimed;
        END IF;
        IF target_span IS NOT NULL THEN
            SELECT * INTO s FROM tallyd.rollup_target(c.counter, '', batch_rows);
            folded := folded + s.folded;
        END IF;
    END LOOP;
    RETURN folded;
END
$$;

-- V11's tallyd.unmatched() with its probes as LATERAL ... LIMIT 1 (one index probe per slot row
-- whatever the statistics say; `NOT EXISTS` could be planned as a hash of the whole target
-- table) under enable_seqscan off.
CREATE OR REPLACE FUNCTION tallyd.unmatched()
RETURNS TABLE (counter text, slot_rows bigint)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
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
                LEFT JOIN LATERAL (SELECT 1 AS found FROM %1$s u WHERE u.%2$I = s.key::%3$s LIMIT 1) u ON true
                WHERE s.counter = $1 AND u.found IS NULL
            $q$, t.target, t.key_column, t.key_type) USING t.counter;
        ELSIF t.insert_missing THEN
            RETURN QUERY SELECT t.counter, 0::bigint;
        ELSE
            RETURN QUERY EXECUTE format($q$
                SELECT $1, count(*) FROM tallyd.slots s
                LEFT JOIN LATERAL (SELECT 1 AS found FROM %1$s u
                                   WHERE u.%2$I = s.key::%3$s AND u.%4$I = %5$s LIMIT 1) u ON true
                WHERE s.counter = $1 AND s.span = $2 AND u.found IS NULL
            $q$, t.target, t.key_column, t.key_type, t.window_column,
                 tallyd.window_value('s', t.window_type, t.time_zone))
                USING t.counter, t.span;
        END IF;
    END LOOP;
END
$$;
