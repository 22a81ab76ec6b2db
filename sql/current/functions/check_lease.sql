-- tallyd.check_lease: last changed by migrations/V4__instance_leases.sql (changed in V4)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- In every flush transaction (through tallyd.record_flush): true while `holder` holds the lease
-- of instance `id`, else an error. The KEY SHARE row lock keeps a takeover from committing
-- between this check and the flush's commit (the takeover waits for the flush), and does not
-- block the holder's own renewals (src/store/lease.rs).
CREATE OR REPLACE FUNCTION tallyd.check_lease(id text, holder text)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM 1 FROM tallyd.instances WHERE instance_id = id AND owner = holder FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tallyd instance % is held by another data_dir: this daemon lost its lease', id
            USING HINT = 'give each tallyd its own [daemon] instance_id';
    END IF;
    RETURN true;
END
$function$;
