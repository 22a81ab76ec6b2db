-- tallyd.rollup_targets_json: last changed by migrations/V18__rollup_into_on_add.sql (changed in V11, V12, V18)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- The targets of tallyd.rollup_shard over tallyd's own tables, from tallyd.rollup_targets, with
-- each one's key type, window column type, kind and on_add columns (each column's constant as an
-- SQL literal cast to the column's type). A target whose key or window column no longer
-- exists has a NULL target: kept out of tallyd.rollups but not folded.
CREATE OR REPLACE FUNCTION tallyd.rollup_targets_json()
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'counter', r.counter,
               'target', CASE WHEN a.attname IS NOT NULL
                               AND (r.window_column IS NULL OR w.attname IS NOT NULL)
                               AND NOT EXISTS (SELECT 1 FROM jsonb_object_keys(r.on_add) k
                                               WHERE NOT EXISTS (
                                                   SELECT 1 FROM pg_attribute o
                                                   WHERE o.attrelid = r.target AND o.attname = k
                                                     AND o.attnum > 0 AND NOT o.attisdropped))
                              THEN r.target::text END,
               'key_column', r.key_column,
               'count_column', r.count_column,
               'key_type', format_type(a.atttypid, a.atttypmod),
               'span', r.span,
               'window_column', r.window_column,
               'window_type', CASE format_type(w.atttypid, w.atttypmod)
                                  WHEN 'date' THEN 'date' ELSE 'timestamptz' END,
               'time_zone', r.time_zone,
               'insert_missing', r.insert_missing,
               'kind', r.kind,
               'on_add', (SELECT coalesce(jsonb_object_agg(e.key, format('%L::%s', e.value #>> '{}',
                                                                 format_type(o.atttypid, o.atttypmod))),
                                          '{}')
                          FROM jsonb_each(r.on_add) e
                          JOIN pg_attribute o ON o.attrelid = r.target AND o.attname = e.key
                                             AND o.attnum > 0 AND NOT o.attisdropped))), '[]')
    FROM tallyd.rollup_targets r
    LEFT JOIN pg_attribute a ON a.attrelid = r.target AND a.attname = r.key_column
    LEFT JOIN pg_attribute w ON w.attrelid = r.target AND w.attname = r.window_column
$function$;
