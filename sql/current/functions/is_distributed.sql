-- tallyd.is_distributed: last changed by migrations/V6__citus_rollup.sql (changed in V6)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Whether `rel` is a distributed (hash) table of Citus; false without Citus.
CREATE OR REPLACE FUNCTION tallyd.is_distributed(rel regclass)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
AS $function$
DECLARE
    found boolean;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1 AND partmethod = ''h'')'
        INTO found USING rel;
    RETURN found;
END
$function$;
