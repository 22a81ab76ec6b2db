-- Idempotent batches (issue 36): tallyd.batches remembers every batch id claimed in this
-- database, so that a second copy of a batch (resent after a lost answer, or sent to another
-- instance on the same database) counts nothing. A claim is final: the first copy to insert
-- the id owns it (its instance and its held payload); the daemon prunes claims older than
-- `batch.remember_days` in bounded steps, by claimed_at.
CREATE TABLE tallyd.batches (
    id          text        PRIMARY KEY,
    instance_id text        NOT NULL,
    payload     bigint      NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batches_claimed_at ON tallyd.batches (claimed_at);
