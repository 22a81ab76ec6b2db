-- tallyd.span_rank: last changed by migrations/V14__set_based_rollup.sql (changed in V14)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- A span's rank as the flush sorts a key's rows (src/window.rs, SpanCode: all, minute, hour, day,
-- week, month), so that a rollup step inserts new tallyd.rollups rows in the flush's order
-- (docs/design.md, "Rollup": why the order).
CREATE OR REPLACE FUNCTION tallyd.span_rank(span text)
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT array_position(ARRAY['all', 'minute', 'hour', 'day', 'week', 'month'], span)
$function$;
