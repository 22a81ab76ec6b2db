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

-- The fold of unique counters' slot rows: up to batch_rows of them (not of the counters in
-- `kept`, which fold into an application's table), claimed and key-locked as every rollup step
-- claims rows, deleted, and their sketches unioned (hll_union_agg) into `rollups`. Dynamic
-- statements, so that this function exists, and tallyd.rollup_fold calls it, only where the
-- hll extension is installed. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_sketches(slots regclass, rollups regclass, batch_rows int,
                                       kept text[])
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    folded bigint;
BEGIN
    EXECUTE format($q$
        WITH claimed AS (
            SELECT s.counter, s.key, s.span, s.win, s.slot FROM %1$s s
            WHERE s.sketch IS NOT NULL
              AND s.counter || E'\n' || s.span <> ALL ($2)
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
                   hll_send(sketch)
            FROM sums
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen),
                sketch = hll_send(hll_union(r.sketch::hll, EXCLUDED.sketch::hll))
        )
        SELECT coalesce(sum(sums.n), 0) FROM sums
    $q$, slots, rollups) INTO folded USING batch_rows, kept;
    RETURN folded;
END
$$;

-- rollup_into for a max, min or unique counter (all-time counters; src/config/counters.rs
-- refuses the others): the target's column keeps the greatest (max), least (min) or the union
-- (unique: an hll column) of its own value and the key's folded slot rows. Claimed, key-locked
-- and limited to keys with a target row, as tallyd.rollup_into_shard (V6) does for sums; the
-- column is bigint or numeric for max and min (src/store/targets.rs checks), so no value
-- leaves its range. Returns the slot rows folded.
CREATE FUNCTION tallyd.rollup_into_kind(slots regclass, counter text, target regclass,
                                        key_column name, value_column name, key_type text,
                                        kind text, batch_rows int)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    agg text := CASE kind WHEN 'max' THEN 'max(value)' WHEN 'min' THEN 'min(value)'
                          WHEN 'unique' THEN 'hll_union_agg(sketch::hll)' END;
    merged text := CASE kind
        WHEN 'max' THEN format('GREATEST(u.%I, sums.v)', value_column)
        WHEN 'min' THEN format('LEAST(u.%I, sums.v)', value_column)
        WHEN 'unique' THEN format('CASE WHEN u.%1$I IS NULL THEN sums.v ELSE hll_union(u.%1$I, sums.v) END',
                                  value_column) END;
BEGIN
    IF agg IS NULL THEN
        RAISE EXCEPTION 'tallyd.rollup_into_kind: kind % cannot fold into a column', kind;
    END IF;
    EXECUTE format($step$
        WITH claimed AS (
            SELECT s.key, s.slot FROM %5$s s
            WHERE s.counter = $1
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
            RETURNING s.key, s.value, s.sketch
        ), sums AS (
            SELECT key::%4$s AS k, %6$s AS v, count(*) AS n FROM removed GROUP BY 1
        ), updated AS (
            UPDATE %1$s u SET %3$I = %7$s FROM sums WHERE u.%2$I = sums.k
        )
        SELECT coalesce(sum(n), 0) FROM sums
    $step$, target, key_column, value_column, key_type, slots, agg, merged)
    INTO n USING counter, batch_rows;
    RETURN n;
END
$$;

ALTER TABLE tallyd.rollup_targets ADD COLUMN kind text NOT NULL DEFAULT 'sum';

-- The targets as V11, with each one's kind.
CREATE OR REPLACE FUNCTION tallyd.rollup_targets_json() RETURNS jsonb
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
               'insert_missing', r.insert_missing,
               'kind', r.kind)), '[]')
    FROM tallyd.rollup_targets r
    LEFT JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
    LEFT JOIN pg_attribute w ON w.attrelid = r.target AND w.attname = r.window_column
$$;


-- One rollup step as V11, a max, min or unique counter's target folded by
-- tallyd.rollup_into_kind.
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
                   span text, kind text);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s WHERE s.counter = $1)', slots)
            INTO pending USING t.counter;
        CONTINUE WHEN NOT pending;
        IF coalesce(t.kind, 'sum') <> 'sum' THEN
            folded := folded + tallyd.rollup_into_kind(slots, t.counter, t.target::regclass,
                                                       t.key_column, t.count_column, t.key_type,
                                                       t.kind, batch_rows);
            CONTINUE;
        END IF;
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
                folded := folded + tallyd.rollup_sketches(slots, rollups, batch_rows, kept);
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
                folded := folded + tallyd.rollup_sketches('tallyd.slots', 'tallyd.rollups', batch_rows,
                                                          kept);
            END IF;
            RETURN folded;
        END
        $body$
    $f$, format(release, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(expire, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'),
         format(fold, 'tallyd.slots', 'tallyd.rollups', 'tallyd.rollup_rejects'));
END
$migration$;

-- Corrections (docs/design.md, "Corrections"). tallyd.correct runs in a flush's transaction,
-- before the flight's upserts: for each corrected key in order, the key's advisory lock (the one
-- every rollup step tries, so that no step folds the key meanwhile), then its stored rows
-- deleted, in every slot (other instances' too) and in tallyd.rollups: a set's window (span,
-- win in Unix ms), or a forget's every row, with what the rollup held back of the key. The
-- flight's upsert then writes the key's new total. A set of a windowed sum also moves the rows
-- written beside the window (its coarser windows, its all-time row: `beside_of` names the
-- correction, from 1) by the window's difference: the set's value, less the window's stored
-- total just deleted, less what the set superseded in memory (`superseded`: those events are in
-- the flight's beside rows), written to this writer's slot (`slots`). Writes only where
-- `tallyd.flushing` is on, as the upserts (src/flush.rs).
CREATE FUNCTION tallyd.correct(counters text[], keys text[], spans text[], wins bigint[],
                               forgets boolean[], set_values bigint[], superseded bigint[],
                               slots int[], beside_of int[], beside_spans text[],
                               beside_wins bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    w timestamptz;
    beside_win timestamptz;
    stored numeric;
    gone numeric;
    delta numeric;
BEGIN
    IF current_setting('tallyd.flushing', true) IS DISTINCT FROM 'on'
       OR coalesce(array_length(keys, 1), 0) = 0 THEN
        RETURN;
    END IF;
    -- Until this transaction commits, no other writes tallyd.slots (flushes of every instance,
    -- rollup steps): it waits for those in progress, so that what committed before the
    -- correction commits is what its DELETEs see (new slot rows too, which no row lock would
    -- hold back), and what commits after it is added to its total. Corrections are rare; the
    -- flushes they hold back wait for one flight.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        PERFORM pg_advisory_xact_lock(1952541816, hashtext(counters[i] || E'\n' || keys[i]));
        IF forgets[i] THEN
            DELETE FROM tallyd.slots WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollups WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollup_rejects WHERE counter = counters[i] AND key = keys[i];
            DELETE FROM tallyd.rollup_held WHERE counter = counters[i] AND key = keys[i];
            CONTINUE;
        END IF;
        w := CASE WHEN wins[i] = -9223372036854775808 THEN '-infinity'::timestamptz
                  ELSE 'epoch'::timestamptz + wins[i] * interval '1 millisecond' END;
        WITH d AS (
            DELETE FROM tallyd.slots
            WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w
            RETURNING count)
        SELECT coalesce(sum(count), 0) INTO stored FROM d;
        WITH d AS (
            DELETE FROM tallyd.rollups
            WHERE counter = counters[i] AND key = keys[i] AND span = spans[i] AND win = w
            RETURNING count)
        SELECT coalesce(sum(count), 0) INTO gone FROM d;
        delta := set_values[i] - stored - gone - superseded[i];
        CONTINUE WHEN delta IS NULL OR delta = 0;
        FOR j IN 1 .. coalesce(array_length(beside_of, 1), 0) LOOP
            CONTINUE WHEN beside_of[j] <> i;
            -- Computed here, not in the INSERT: Citus evaluates an INSERT's expressions on the
            -- coordinator arm by arm, so the ELSE arm of an all-time row's CASE would fail
            -- ("interval out of range") and the flush with it, at every retry.
            beside_win := CASE WHEN beside_wins[j] = -9223372036854775808 THEN '-infinity'::timestamptz
                               ELSE 'epoch'::timestamptz + beside_wins[j] * interval '1 millisecond' END;
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            VALUES (counters[i], keys[i], beside_spans[j], beside_win, slots[i], delta, now(), now())
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET count = s.count + EXCLUDED.count;
        END LOOP;
    END LOOP;
END
$$;

-- The same corrections from SQL, inside the application's own transaction: exact with respect
-- to commits (increments committed before this transaction commits are superseded, later ones
-- are added; what a tallyd holds in memory commits later, so it is added), as a second tallyd
-- instance's correction is. `key` in the counter's canonical form (docs/protocol.md, "Keys").

-- Forgets `key` in `counter`: every row, in every window and slot. Returns the rows deleted.
CREATE FUNCTION tallyd.forget(counter text, key text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    m bigint;
BEGIN
    -- As tallyd.correct: writers of tallyd.slots wait for this transaction.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(1952541816, hashtext(forget.counter || E'\n' || forget.key));
    DELETE FROM tallyd.slots s WHERE s.counter = forget.counter AND s.key = forget.key;
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM tallyd.rollups r WHERE r.counter = forget.counter AND r.key = forget.key;
    GET DIAGNOSTICS m = ROW_COUNT;
    DELETE FROM tallyd.rollup_rejects j WHERE j.counter = forget.counter AND j.key = forget.key;
    DELETE FROM tallyd.rollup_held h WHERE h.counter = forget.counter AND h.key = forget.key;
    RETURN n + m;
END
$$;

-- Forgets `key` in every counter that has rows of it. Returns the rows deleted.
CREATE FUNCTION tallyd.forget(key text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    c text;
    n bigint := 0;
BEGIN
    FOR c IN SELECT DISTINCT counter FROM tallyd.slots s WHERE s.key = forget.key
             UNION SELECT DISTINCT counter FROM tallyd.rollups r WHERE r.key = forget.key
             ORDER BY 1
    LOOP
        n := n + tallyd.forget(c, forget.key);
    END LOOP;
    RETURN n;
END
$$;

-- Sets `key`'s all-time total in `counter` to `total`: its rows deleted, one rollup row of
-- `total` written. Refused for a counter with windowed rows (their totals would disagree) or
-- rows of another kind than sum, and for a counter folded into an application's table. A
-- counter with no rows at all is taken for an all-time sum: if the config declares it another
-- kind, tallyd's next start refuses it (src/store/kinds.rs).
CREATE FUNCTION tallyd.set_total(counter text, key text, total bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- As tallyd.correct: writers of tallyd.slots wait for this transaction.
    LOCK TABLE tallyd.slots IN SHARE ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(1952541816, hashtext(set_total.counter || E'\n' || set_total.key));
    IF EXISTS (SELECT 1 FROM tallyd.rollup_targets t WHERE t.counter = set_total.counter) THEN
        RAISE EXCEPTION 'tallyd.set_total: counter % folds into an application''s table: set its column there', set_total.counter;
    END IF;
    IF EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = set_total.counter
                  AND (s.span <> 'all' OR s.kind IS NOT NULL))
       OR EXISTS (SELECT 1 FROM tallyd.rollups r WHERE r.counter = set_total.counter
                  AND (r.span <> 'all' OR r.kind IS NOT NULL)) THEN
        RAISE EXCEPTION 'tallyd.set_total: counter % is not an all-time sum (it has windowed rows or rows of another kind)', set_total.counter;
    END IF;
    DELETE FROM tallyd.slots s WHERE s.counter = set_total.counter AND s.key = set_total.key;
    DELETE FROM tallyd.rollups r WHERE r.counter = set_total.counter AND r.key = set_total.key;
    DELETE FROM tallyd.rollup_rejects j WHERE j.counter = set_total.counter AND j.key = set_total.key;
    INSERT INTO tallyd.rollups (counter, key, count, first_seen, last_seen)
    VALUES (set_total.counter, set_total.key, total, now(), now());
END
$$;
