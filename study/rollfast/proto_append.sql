-- Design (c), priced: slot rows appended (no index, no ON CONFLICT) into the open partition of
-- an interval; the rollup folds a closed partition whole (one GROUP BY, one upsert per target
-- row) and truncates it. rollperf.slots_append stands for one partition.
CREATE SCHEMA IF NOT EXISTS rollperf;
DROP TABLE IF EXISTS rollperf.slots_append;
CREATE TABLE rollperf.slots_append (
    counter text NOT NULL, key text NOT NULL, span text NOT NULL, win timestamptz NOT NULL,
    slot int NOT NULL, count bigint NOT NULL, first_seen timestamptz NOT NULL,
    last_seen timestamptz NOT NULL);

-- The fold of a closed partition into the windowed target, in one transaction with its TRUNCATE.
CREATE OR REPLACE FUNCTION rollperf.fold_partition() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE folded bigint;
BEGIN
    WITH sums AS (
        SELECT key::bigint AS k, ((win + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date AS w,
               sum(count)::bigint AS n, count(*) AS rows
        FROM rollperf.slots_append WHERE counter = 'vd' AND span = 'day' GROUP BY 1, 2
    ), written AS (
        INSERT INTO public.version_downloads AS u (version_id, date, downloads)
        SELECT k, w, n FROM sums ORDER BY k, w
        ON CONFLICT (version_id, date) DO UPDATE SET downloads = coalesce(u.downloads, 0) + EXCLUDED.downloads
    )
    SELECT sum(rows) INTO folded FROM sums;
    TRUNCATE rollperf.slots_append;
    RETURN folded;
END
$$;
