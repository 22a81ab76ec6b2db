-- tallyd's schema: slotted rows written by flushes, the rolled-up summary, the exact totals view,
-- and the flush ledger that makes retries after an unknown COMMIT outcome safe.

CREATE SCHEMA IF NOT EXISTS tallyd;

-- One row per (counter, key, slot). Each tallyd flush connection writes its own slot, so writers
-- never wait on each other's row locks. fillfactor leaves room on each page for HOT updates:
-- `count` is not indexed, so an update can stay on its page without touching the index.
CREATE TABLE tallyd.slots (
    counter    text        NOT NULL,
    key        text        NOT NULL,
    slot       int         NOT NULL,
    count      bigint      NOT NULL,
    first_seen timestamptz NOT NULL,
    last_seen  timestamptz NOT NULL,
    PRIMARY KEY (counter, key, slot)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05);

-- The summary: one row per (counter, key), filled by the rollup.
CREATE TABLE tallyd.rollups (
    counter    text        NOT NULL,
    key        text        NOT NULL,
    count      bigint      NOT NULL,
    first_seen timestamptz NOT NULL,
    last_seen  timestamptz NOT NULL,
    PRIMARY KEY (counter, key)
) WITH (fillfactor = 80);

-- Exact at any moment: what is rolled up plus what is still in slots. Applications read this.
-- Filters on counter and key are pushed into both branches, so a lookup of one key stays an
-- index scan.
CREATE VIEW tallyd.totals AS
SELECT counter, key,
       sum(count)::bigint AS count,
       min(first_seen)    AS first_seen,
       max(last_seen)     AS last_seen
FROM (
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.rollups
    UNION ALL
    SELECT counter, key, count, first_seen, last_seen FROM tallyd.slots
) AS parts
GROUP BY counter, key;

-- The flush ledger: the last committed flush sequence number of each writer (instance, connection),
-- updated in the same transaction as the flush. After a connection dies during COMMIT, tallyd
-- reads it back to learn whether that flush landed, so it is neither lost nor applied twice.
CREATE TABLE tallyd.flushes (
    instance_id  text        NOT NULL,
    writer       int         NOT NULL,
    seq          bigint      NOT NULL,
    -- Every journal record up to this sequence number has all of this writer's events committed.
    journal_covered bigint   NOT NULL DEFAULT 0,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (instance_id, writer)
);
