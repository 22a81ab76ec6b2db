-- Design (a), the direct fold in the flush transaction, next to today's slot upsert, replayed
-- from recorded flights (rollperf.flights, filled by flights.py) so that both write the same
-- rows. rollperf.flush(flight, worker, mode) loads the flight into arrays as tallyd sends them
-- (unnest parameters), then writes it in chunks of 5,000 rows with one of:
--   'none'   nothing (the cost of loading the arrays, subtracted from the others)
--   'slots'  today's UPSERT_SUMS (src/flush.rs), all rows into tallyd.slots
--   'direct' design (a): rows whose (key, window) row exists in version_downloads and is not
--            locked by another transaction are added to it; the rest go to tallyd.slots as today
--   'direct_insert' as 'direct', and missing rows inserted into version_downloads too
--            (ON CONFLICT DO NOTHING; only for a target without foreign keys: a measurement)
--   'mover'  the Redis peer's upsert into version_downloads (bench/src/mover.rs), for comparison
--   'rollups' an all-time counter: the flight's rows added straight to tallyd.rollups (existing
--            rows locked SKIP LOCKED and updated, missing rows inserted ON CONFLICT DO NOTHING),
--            what is left to tallyd.slots
-- then records the flight in rollperf.ledger (the ledger row's update, as tallyd.record_flush).
CREATE SCHEMA IF NOT EXISTS rollperf;
CREATE TABLE IF NOT EXISTS rollperf.flights (
    flight int NOT NULL, worker int NOT NULL, key text NOT NULL, n bigint NOT NULL,
    chunk int NOT NULL DEFAULT 0,  -- statements of flush.batch_rows (5,000) rows, in key order
    PRIMARY KEY (flight, worker, chunk, key));
CREATE TABLE IF NOT EXISTS rollperf.ledger (worker int PRIMARY KEY, seq bigint NOT NULL);

DROP FUNCTION IF EXISTS rollperf.flush(int, int, text, text, text, int);
DROP FUNCTION IF EXISTS rollperf.flush(int, int, text, text, text);
CREATE OR REPLACE FUNCTION rollperf.flush(p_flight int, p_worker int, p_mode text, p_counter text DEFAULT 'vd',
                                          p_span text DEFAULT 'day')
-- enable_seqscan off: the probes stay index probes whatever the statistics say (a plan cached
-- while the target looked empty must not scan it per row); tallyd would SET LOCAL it with the
-- flush's other settings.
RETURNS bigint LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    keys text[]; counts bigint[]; firsts timestamptz[]; lasts timestamptz[];
    counters text[]; slotsv int[]; spans text[]; wins bigint[];
    total int; ch int;
    -- today's Berlin day, as tallyd computes the window: its first instant in Unix ms
    day_ms bigint := CASE WHEN p_span = 'all' THEN -9223372036854775808 ELSE
        (extract(epoch FROM (date_trunc('day', now() AT TIME ZONE 'Europe/Berlin') AT TIME ZONE 'Europe/Berlin')) * 1000)::bigint END;
    written bigint := 0;
BEGIN
    IF p_mode IN ('upsert', 'upsert_rollups') THEN
        -- the direct statements' short lock wait, and the flight's ROW EXCLUSIVE on tallyd.slots
        -- (so that a correction orders against it even when it writes no slot row)
        PERFORM set_config('lock_timeout', '200ms', true);
        LOCK TABLE tallyd.slots IN ROW EXCLUSIVE MODE;
    END IF;
    -- one chunk's arrays at a time, as tallyd binds each statement's parameters
    FOR ch IN SELECT DISTINCT chunk FROM rollperf.flights
              WHERE flight = p_flight AND worker = p_worker ORDER BY chunk LOOP
        SELECT array_agg(key ORDER BY key), array_agg(n ORDER BY key) INTO keys, counts
        FROM rollperf.flights WHERE flight = p_flight AND worker = p_worker AND chunk = ch;
        total := coalesce(array_length(keys, 1), 0);
        counters := array_fill(p_counter, ARRAY[total]);
        slotsv := array_fill(p_worker, ARRAY[total]);
        firsts := array_fill(now(), ARRAY[total]);
        lasts := firsts;
        spans := array_fill(p_span, ARRAY[total]);
        wins := array_fill(day_ms, ARRAY[total]);
        IF p_mode = 'slots' THEN
            -- src/flush.rs UPSERT_SUMS[0], verbatim but for the parameters' names
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            SELECT c, k, sp, CASE WHEN w = -9223372036854775808 THEN '-infinity'::timestamptz
                                  ELSE 'epoch'::timestamptz + w * interval '1 millisecond' END, sl, n, f, l
            FROM unnest(counters, keys, slotsv, counts, firsts, lasts,
                        spans, wins)
            AS u (c, k, sl, n, f, l, sp, w)
            WHERE current_setting('tallyd.flushing', true) = 'on'
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
                count = s.count + EXCLUDED.count,
                first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen);
        ELSIF p_mode IN ('direct', 'direct_insert') THEN
            -- Design (a). Per target row (keys that cast alike share one) the flight's sum; its
            -- existing row found by one index probe (LATERAL ... LIMIT 1, so that no cached plan
            -- hashes the whole target table), locked unless another transaction holds it
            -- (FOR NO KEY UPDATE SKIP LOCKED: never waits on the application), and added to.
            -- 'direct_insert' also inserts the missing rows (ON CONFLICT DO NOTHING: a row another
            -- transaction inserted first goes to slots). Everything else goes to tallyd.slots with
            -- today's upsert, in the same statement, so in the same transaction as the ledger row.
            WITH r AS MATERIALIZED (
                SELECT c, k, sl, n, f, l, sp, w, k::bigint AS tk,
                       (('epoch'::timestamptz + w * interval '1 millisecond' + interval '12 hours')
                        AT TIME ZONE 'Europe/Berlin')::date AS tw
                FROM unnest(counters, keys, slotsv, counts, firsts, lasts, spans, wins)
                AS u (c, k, sl, n, f, l, sp, w)
                WHERE current_setting('tallyd.flushing', true) = 'on'
            ), t AS MATERIALIZED (
                SELECT t.tk, t.tw, t.n, u.utid
                FROM (SELECT tk, tw, sum(n) AS n FROM r GROUP BY tk, tw) t
                LEFT JOIN LATERAL (SELECT v.ctid AS utid FROM public.version_downloads v
                                   WHERE v.version_id = t.tk AND v.date = t.tw LIMIT 1) u ON true
            ), locked AS MATERIALIZED (
                SELECT v.ctid AS utid FROM public.version_downloads v
                WHERE v.ctid = ANY (ARRAY(SELECT utid FROM t WHERE utid IS NOT NULL))
                FOR NO KEY UPDATE OF v SKIP LOCKED
            ), direct AS (
                UPDATE public.version_downloads v SET downloads = coalesce(v.downloads, 0) + t.n
                FROM t JOIN locked l ON l.utid = t.utid WHERE v.ctid = t.utid
                RETURNING v.version_id AS tk, v.date AS tw
            ), inserted AS (
                INSERT INTO public.version_downloads AS v (version_id, date, downloads)
                SELECT t.tk, t.tw, t.n FROM t WHERE t.utid IS NULL AND p_mode = 'direct_insert'
                ORDER BY t.tk, t.tw
                ON CONFLICT (version_id, date) DO NOTHING
                RETURNING v.version_id AS tk, v.date AS tw
            )
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            SELECT c, k, sp, 'epoch'::timestamptz + w * interval '1 millisecond', sl, n, f, l
            FROM r WHERE (tk, tw) NOT IN (SELECT tk, tw FROM direct UNION ALL SELECT tk, tw FROM inserted)
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
                count = s.count + EXCLUDED.count,
                first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen);
        ELSIF p_mode = 'direct_nolock' THEN
            -- a measurement only: 'direct' without the SKIP LOCKED lock (the UPDATE would wait on
            -- a row the application holds), to price the lock
            WITH r AS MATERIALIZED (
                SELECT c, k, sl, n, f, l, sp, w, k::bigint AS tk,
                       (('epoch'::timestamptz + w * interval '1 millisecond' + interval '12 hours')
                        AT TIME ZONE 'Europe/Berlin')::date AS tw
                FROM unnest(counters, keys, slotsv, counts, firsts, lasts, spans, wins)
                AS u (c, k, sl, n, f, l, sp, w)
                WHERE current_setting('tallyd.flushing', true) = 'on'
            ), direct AS (
                UPDATE public.version_downloads v SET downloads = coalesce(v.downloads, 0) + t.n
                FROM (SELECT tk, tw, sum(n) AS n FROM r GROUP BY tk, tw) t
                WHERE v.version_id = t.tk AND v.date = t.tw
                RETURNING v.version_id AS tk, v.date AS tw
            )
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            SELECT c, k, sp, 'epoch'::timestamptz + w * interval '1 millisecond', sl, n, f, l
            FROM r WHERE (tk, tw) NOT IN (SELECT tk, tw FROM direct)
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
                count = s.count + EXCLUDED.count,
                first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen);
        ELSIF p_mode = 'append' THEN
            -- design (c): appended to the open partition (proto_append.sql), no index, no conflict
            INSERT INTO rollperf.slots_append (counter, key, span, win, slot, count, first_seen, last_seen)
            SELECT c, k, sp, 'epoch'::timestamptz + w * interval '1 millisecond', sl, n, f, l
            FROM unnest(counters, keys, slotsv, counts, firsts, lasts, spans, wins)
            AS u (c, k, sl, n, f, l, sp, w)
            WHERE current_setting('tallyd.flushing', true) = 'on';
        ELSIF p_mode = 'upsert' THEN
            -- issue 32's hypothesis: the flush writes the window rows straight into the target
            -- with the peer's plain upsert (insert_missing), in the ledgered transaction, under a
            -- short lock_timeout (set once per flight, below); the window's date as the rollup
            -- computes it (tallyd.window_value) from the flush's win (Unix ms)
            INSERT INTO public.version_downloads AS u (version_id, date, downloads)
            SELECT k::bigint, (('epoch'::timestamptz + w * interval '1 millisecond' + interval '12 hours')
                               AT TIME ZONE 'Europe/Berlin')::date, n
            FROM unnest(keys, wins, counts) AS x (k, w, n)
            WHERE current_setting('tallyd.flushing', true) = 'on'
            ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads;
        ELSIF p_mode = 'upsert_rollups' THEN
            -- the same for tallyd.rollups: the slot upsert's statement with the table changed
            INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen)
            SELECT c, k, sp, CASE WHEN w = -9223372036854775808 THEN '-infinity'::timestamptz
                                  ELSE 'epoch'::timestamptz + w * interval '1 millisecond' END, n, f, l
            FROM unnest(counters, keys, counts, firsts, lasts, spans, wins)
            AS u (c, k, n, f, l, sp, w)
            WHERE current_setting('tallyd.flushing', true) = 'on'
            ON CONFLICT (counter, key, span, win) DO UPDATE SET
                count = r.count + EXCLUDED.count,
                first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen);
        ELSIF p_mode = 'mover' THEN
            -- the Redis peer's mover (bench/src/mover.rs UPSERT), for comparison on the same rows
            INSERT INTO public.version_downloads (version_id, date, downloads)
            SELECT v::bigint, (now() AT TIME ZONE 'Europe/Berlin')::date, n FROM unnest(keys, counts) AS t(v, n)
            ON CONFLICT (version_id, date)
            DO UPDATE SET downloads = version_downloads.downloads + EXCLUDED.downloads;
        ELSIF p_mode = 'rollups' THEN
            WITH r AS MATERIALIZED (
                SELECT c, k, sl, n, f, l, sp,
                       CASE WHEN w = -9223372036854775808 THEN '-infinity'::timestamptz
                            ELSE 'epoch'::timestamptz + w * interval '1 millisecond' END AS w
                FROM unnest(counters, keys, slotsv, counts, firsts,
                            lasts, spans, wins)
                AS u (c, k, sl, n, f, l, sp, w)
                WHERE current_setting('tallyd.flushing', true) = 'on'
            ), locked AS MATERIALIZED (
                SELECT x.ctid AS xtid, r.n, r.f, r.l FROM r
                JOIN tallyd.rollups x ON x.counter = r.c AND x.key = r.k AND x.span = r.sp AND x.win = r.w
                FOR NO KEY UPDATE OF x SKIP LOCKED
            ), direct AS (
                UPDATE tallyd.rollups x SET count = x.count + l.n,
                    first_seen = LEAST(x.first_seen, l.f), last_seen = GREATEST(x.last_seen, l.l)
                FROM locked l WHERE x.ctid = l.xtid
                RETURNING x.counter AS c, x.key AS k, x.span AS sp, x.win AS w
            ), inserted AS (
                INSERT INTO tallyd.rollups AS x (counter, key, span, win, count, first_seen, last_seen)
                SELECT c, k, sp, w, n, f, l FROM r
                WHERE NOT EXISTS (SELECT 1 FROM tallyd.rollups y
                                  WHERE y.counter = r.c AND y.key = r.k AND y.span = r.sp AND y.win = r.w)
                ON CONFLICT (counter, key, span, win) DO NOTHING
                RETURNING x.counter AS c, x.key AS k, x.span AS sp, x.win AS w
            )
            INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen)
            SELECT c, k, sp, w, sl, n, f, l FROM r
            WHERE NOT EXISTS (SELECT 1 FROM direct d WHERE (d.c, d.k, d.sp, d.w) = (r.c, r.k, r.sp, r.w))
              AND NOT EXISTS (SELECT 1 FROM inserted i WHERE (i.c, i.k, i.sp, i.w) = (r.c, r.k, r.sp, r.w))
            ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
                count = s.count + EXCLUDED.count,
                first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
                last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen);
        END IF;
        written := written + total;
    END LOOP;
    INSERT INTO rollperf.ledger AS g VALUES (p_worker, p_flight)
    ON CONFLICT (worker) DO UPDATE SET seq = EXCLUDED.seq WHERE g.seq < EXCLUDED.seq;
    RETURN written;
END
$$;
