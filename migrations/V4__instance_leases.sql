-- Which tallyd holds each instance id. Two daemons with one instance_id (a copied config) would
-- share the flush ledger and slots; the holder of a lease row is the only one that may write.
-- `owner` is a token kept in the holder's data_dir, so the same data_dir restarting after a
-- crash takes its lease back at once. Times are the server's, so clocks of hosts never matter.
CREATE TABLE tallyd.instances (
    instance_id  text        PRIMARY KEY,
    owner        text        NOT NULL,
    host         text        NOT NULL,
    pid          int         NOT NULL,
    data_dir     text        NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);

-- The ledger is per data_dir (the journal it covers lives there): after an instance id passed
-- from one data_dir to another, each one's `journal_covered` still describes its own journal.
-- Rows of older versions have owner '' until their data_dir claims them (store/lease.rs).
ALTER TABLE tallyd.flushes ADD COLUMN owner text NOT NULL DEFAULT '';
ALTER TABLE tallyd.flushes DROP CONSTRAINT flushes_pkey;
ALTER TABLE tallyd.flushes ADD PRIMARY KEY (instance_id, owner, writer);

-- In every flush transaction: true while `holder` holds the lease of `id`, else an error. The
-- row lock keeps a takeover (which locks FOR UPDATE) from committing between this check and the
-- flush's commit; KEY SHARE does not block the holder's own renewals.
CREATE FUNCTION tallyd.check_lease(id text, holder text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM tallyd.instances WHERE instance_id = id AND owner = holder FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tallyd instance % is held by another data_dir: this daemon lost its lease', id
            USING HINT = 'give each tallyd its own [daemon] instance_id';
    END IF;
    RETURN true;
END
$$;
