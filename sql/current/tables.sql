-- tallyd's tables as migrations V1.. leave them: columns in their order on disk, defaults,
-- constraints, indexes, storage options and the one seeded row. Read-only copy: change a table
-- by a new migration, then here (migrations/README.md); tests/schema.rs compares the two.
--
-- Not here, because a migration does not make them:
-- - tallyd.schema_history: refinery's record of the applied migrations (version, name, checksum).
-- - Slot partitions: with `[database] slot_partitions = N` (N > 0), each start rebuilds
--   tallyd.slots as `PARTITION BY HASH (key)` with tables tallyd.slots_p0 .. slots_p<N-1>
--   (fillfactor 70, autovacuum_vacuum_scale_factor 0.02), and back to the plain table below
--   with 0 (src/store/mod.rs, ensure_slot_partitions).
-- - On Citus, `tallyd migrate` distributes slots, rollups and rollup_rejects on `key`,
--   colocated, and the rollup's worker functions (src/store/citus.rs).
-- - tallyd.unique_totals: views/unique_totals.sql.

CREATE SCHEMA IF NOT EXISTS tallyd;

-- tallyd.slots: last changed by migrations/V12__counter_kinds.sql (changed in V1, V10, V12)
--
-- One row per (counter, key, window, slot): what the flushes wrote and the rollup has not
-- folded yet. Each flush connection writes its own slot, so writers never wait on each other's
-- row locks. fillfactor leaves room on each page for HOT updates: `count` is not indexed, so an
-- update can stay on its page without touching the index.
-- span, win (V10): the window's length ('minute' .. 'month', or 'all') and first instant
-- ('-infinity' for an all-time row). kind, value, sketch (V12): NULL kind for a sum; `count` is
-- the number of events for every other kind; `value` a max, min or last value; `sketch` a
-- unique counter's postgresql-hll sketch in the hll type's own bytes (`sketch::hll` reads it).
CREATE TABLE tallyd.slots (
    counter    text        NOT NULL,
    key        text        NOT NULL,
    slot       int         NOT NULL,
    count      bigint      NOT NULL,
    first_seen timestamptz NOT NULL,
    last_seen  timestamptz NOT NULL,
    span       text        NOT NULL DEFAULT 'all',
    win        timestamptz NOT NULL DEFAULT '-infinity',
    kind       text,
    value      bigint,
    sketch     bytea,
    PRIMARY KEY (counter, key, span, win, slot)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05);

-- tallyd.rollups: last changed by migrations/V12__counter_kinds.sql (changed in V1, V10, V12)
--
-- The summary: one row per (counter, key, window), filled by the rollup. Columns as in slots.
CREATE TABLE tallyd.rollups (
    counter    text        NOT NULL,
    key        text        NOT NULL,
    count      bigint      NOT NULL,
    first_seen timestamptz NOT NULL,
    last_seen  timestamptz NOT NULL,
    span       text        NOT NULL DEFAULT 'all',
    win        timestamptz NOT NULL DEFAULT '-infinity',
    kind       text,
    value      bigint,
    sketch     bytea,
    PRIMARY KEY (counter, key, span, win)
) WITH (fillfactor = 80);

-- tallyd.flushes: last changed by migrations/V21__unique_coverage.sql (changed in V1, V4, V21)
--
-- The flush ledger: the last committed flush (flight) of each writer, written in the flush's
-- own transaction by tallyd.record_flush, so that after a connection died during COMMIT tallyd
-- reads whether that flush landed. Per data_dir (`owner`, V4: the lease token of the data_dir
-- whose journal it covers; '' for rows of older versions until their data_dir claims them).
-- `journal_covered`: every journal record up to it has all of this writer's events committed;
-- `unique_covered` (V21): its unique counters' events only up to it (NULL: as journal_covered),
-- lower while the writer holds their rows back because the hll extension is missing.
CREATE TABLE tallyd.flushes (
    instance_id     text        NOT NULL,
    writer          int         NOT NULL,
    seq             bigint      NOT NULL,
    journal_covered bigint      NOT NULL DEFAULT 0,
    committed_at    timestamptz NOT NULL DEFAULT now(),
    owner           text        NOT NULL DEFAULT '',
    unique_covered  bigint,
    PRIMARY KEY (instance_id, owner, writer)
);

-- tallyd.rollup_targets: last changed by migrations/V18__rollup_into_on_add.sql (changed in V2, V11, V12, V18)
--
-- Counters whose rollup folds into a column of the application's own table instead of
-- tallyd.rollups. Rewritten from config.toml whenever tallyd prepares the database
-- (src/store/targets.rs). window_column (NULL: an all-time target), span, time_zone and
-- insert_missing describe a windowed target (V11); kind (V12) a max, min or unique target;
-- on_add (V18) the columns set to a constant whenever tallyd adds to a row (column -> value).
CREATE TABLE tallyd.rollup_targets (
    counter        text     PRIMARY KEY,
    target         regclass NOT NULL,
    key_column     name     NOT NULL,
    count_column   name     NOT NULL,
    window_column  name,
    span           text     NOT NULL DEFAULT 'all',
    time_zone      text     NOT NULL DEFAULT 'UTC',
    insert_missing boolean  NOT NULL DEFAULT false,
    kind           text     NOT NULL DEFAULT 'sum',
    on_add         jsonb    NOT NULL DEFAULT '{}'::jsonb
);

-- tallyd.shards: last changed by migrations/V3__shard_map.sql (changed in V3)
--
-- Which logical shards this database owns, out of how many. Written when tallyd first prepares
-- the database; tallyd refuses to start when its configured map disagrees with it.
CREATE TABLE tallyd.shards (
    shard          int PRIMARY KEY,
    logical_shards int NOT NULL
);

-- tallyd.instances: last changed by migrations/V4__instance_leases.sql (changed in V4)
--
-- Which tallyd holds each instance id (src/store/lease.rs). `owner` is a token kept in the
-- holder's data_dir. It is part of a unique key, so a takeover (which changes it) must lock the
-- row FOR UPDATE, while a renewal (which does not) locks it FOR NO KEY UPDATE, and the KEY SHARE
-- lock of tallyd.check_lease in every flush makes a takeover wait for the holder's flushes.
CREATE TABLE tallyd.instances (
    instance_id  text        PRIMARY KEY,
    owner        text        NOT NULL,
    host         text        NOT NULL,
    pid          int         NOT NULL,
    data_dir     text        NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);
CREATE UNIQUE INDEX instances_owner ON tallyd.instances (instance_id, owner);

-- tallyd.rollup_rejects: last changed by migrations/V5__rollup_overflow_guard.sql (changed in V5)
--
-- Keys the rollup did not fold because a folded total would leave the range of what it adds
-- into. Their slot rows stay in tallyd.slots, so the totals stay exact. `total`: what the fold
-- would have produced (NULL for rollup_into counters: the target column's type raised; those
-- are retried after a minute, summary keys once their total fits again).
CREATE TABLE tallyd.rollup_rejects (
    counter     text        NOT NULL,
    key         text        NOT NULL,
    total       numeric,
    rejected_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (counter, key)
);

-- tallyd.shard_map_version: last changed by migrations/V8__shard_map_version.sql (changed in V8)
--
-- The version of this database's shard ownership (one row). A shard move raises it in every
-- database that loses shards; every flush checks it first (tallyd.check_shard_map).
CREATE TABLE tallyd.shard_map_version (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint  NOT NULL
);
INSERT INTO tallyd.shard_map_version (one, version) VALUES (true, 1);

-- tallyd.rollup_held: last changed by migrations/V11__windowed_rollup_into.sql (changed in V11)
--
-- Keys of insert_missing targets whose insert failed on a foreign key. Their slot rows stay in
-- tallyd.slots; the batch fold skips them, and each is retried on its own 1 s after it was
-- held, then after 2, 4, ... up to 60 s between tries, and deleted from here once it folds.
-- `cause`: the error of the last try (it names the constraint).
CREATE TABLE tallyd.rollup_held (
    counter  text        NOT NULL,
    key      text        NOT NULL,
    cause    text        NOT NULL,
    held_at  timestamptz NOT NULL DEFAULT now(),
    attempts int         NOT NULL DEFAULT 1,
    retry_at timestamptz NOT NULL DEFAULT now() + interval '1 second',
    PRIMARY KEY (counter, key)
);

-- tallyd.batches: last changed by migrations/V16__batches.sql (changed in V16)
--
-- Every batch id claimed in this database: the first copy to insert the id owns it (its
-- instance and its held payload); every other copy of the batch is dropped. The daemon prunes
-- claims older than `batch.remember_days` in bounded steps, by claimed_at.
CREATE TABLE tallyd.batches (
    id          text        PRIMARY KEY,
    instance_id text        NOT NULL,
    payload     bigint      NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batches_claimed_at ON tallyd.batches (claimed_at);
