-- tallyd.rollup_summary_sketches: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- tallyd.rollup_summary for a unique counter: its sketches claimed, probed and folded the same way,
-- unioned by the hll extension (hll_union_agg, hll_union), which exists wherever a unique counter
-- is declared (src/store/kinds.rs). PL/pgSQL resolves those names only when a statement first
-- runs, so this function exists everywhere.
CREATE OR REPLACE FUNCTION tallyd.rollup_summary_sketches(counter_name text, except_span text, after_key text, batch_rows integer, OUT folded bigint, OUT claimed bigint, OUT last_key text)
 RETURNS record
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
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
$function$;
