-- tallyd.rollup_counters: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Which counters have slot rows, and their kind (a counter's rows are all of one kind): a loose
-- index scan, one descent of the primary key per counter. tallyd.rollup() steps each; the daemon
-- adds the counters it finds here that its configuration does not declare.
CREATE OR REPLACE FUNCTION tallyd.rollup_counters()
 RETURNS TABLE(counter text, kind text)
 LANGUAGE sql
 STABLE
AS $function$
    WITH RECURSIVE found AS (
        (SELECT s.counter, s.kind FROM tallyd.slots s ORDER BY s.counter LIMIT 1)
        UNION ALL
        SELECT n.counter, n.kind FROM found f
        CROSS JOIN LATERAL (SELECT s.counter, s.kind FROM tallyd.slots s
                            WHERE s.counter > f.counter ORDER BY s.counter LIMIT 1) n
    )
    SELECT found.counter, coalesce(found.kind, 'sum') FROM found
$function$;
