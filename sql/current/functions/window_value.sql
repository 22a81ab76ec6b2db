-- tallyd.window_value: last changed by migrations/V11__windowed_rollup_into.sql (changed in V11)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The value of a target's window column for the slot row aliased `alias`, as SQL text: the
-- window's first instant (a timestamptz column), or its first day in `time_zone` (a date column).
-- The day is read 12 hours into the window, so that a server whose zone database puts midnight an
-- hour or two away from tallyd's (an older tzdata) still names the same day.
CREATE OR REPLACE FUNCTION tallyd.window_value(alias text, window_type text, time_zone text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE WHEN window_type = 'date'
                THEN format('((%I.win + interval ''12 hours'') AT TIME ZONE %L)::date', alias, time_zone)
                ELSE format('%I.win', alias) END
$function$;
