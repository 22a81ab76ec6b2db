-- tallyd.rollup_shard: last changed by migrations/V12__counter_kinds.sql (changed in V6, V7, V11, V12)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- One rollup step over the given relations: slots, rollups and rollup_rejects, and for each
-- rollup_into counter its target. On a Citus worker these are the colocated shards of one shard
-- group; on plain PostgreSQL tallyd's own tables. Returns the slot rows folded.
--
-- `targets` is a JSON array of {counter, target, key_column, count_column, key_type, span, kind,
-- and for a windowed target window_column, window_type, time_zone, insert_missing}; a NULL target
-- keeps the counter out of `rollups` without folding it. The fold (tallyd.rollup_fold_own over
-- tallyd's own tables, whose plans PL/pgSQL keeps for the session; tallyd.rollup_fold for other
-- relations) leaves out the rows that go to a target: every row of an all-time target, the
-- window's rows of a windowed one (whose `also` rows fold into `rollups`). Then each target with
-- slot rows folds: a max, min or unique counter's by tallyd.rollup_into_kind, a windowed one's by
-- tallyd.rollup_into_windows, a sum's all-time one by tallyd.rollup_into_shard, and if some key's
-- column would leave its type's range, key by key among the keys that have a row in the target,
-- in key order, each in its own subtransaction, holding back only the keys that fail
-- (tallyd.rollup_rejects). Citus refuses changes to a shard from an ordinary session unless
-- citus.enable_manual_changes_to_shards is on: set only where Citus defines it.
CREATE OR REPLACE FUNCTION tallyd.rollup_shard(slots regclass, rollups regclass, rejects regclass, targets jsonb, batch_rows integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    kept text[] := ARRAY(SELECT (x ->> 'counter') || E'\n' || coalesce(x ->> 'span', 'all')
                         FROM jsonb_array_elements(targets) x);
    folded bigint;
    n bigint;
    pending boolean;
    w jsonb;
    t record;
    k record;
BEGIN
    -- Citus refuses changes to a shard from an ordinary session unless this is on. Only where
    -- Citus defines the setting: plain PostgreSQL is left as it was.
    IF current_setting('citus.enable_manual_changes_to_shards', true) IS NOT NULL THEN
        PERFORM set_config('citus.enable_manual_changes_to_shards', 'on', true);
    END IF;

    IF (slots, rollups, rejects) = (to_regclass('tallyd.slots'), to_regclass('tallyd.rollups'),
                                    to_regclass('tallyd.rollup_rejects')) THEN
        folded := tallyd.rollup_fold_own(batch_rows, kept);
    ELSE
        folded := tallyd.rollup_fold(slots, rollups, rejects, batch_rows, kept);
    END IF;

    FOR w IN SELECT x FROM jsonb_array_elements(targets) x WHERE x ->> 'target' IS NOT NULL
    LOOP
        SELECT x.* INTO t
        FROM jsonb_to_record(w)
             AS x (counter text, target text, key_column name, count_column name, key_type text,
                   span text, kind text);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s WHERE s.counter = $1)', slots)
            INTO pending USING t.counter;
        CONTINUE WHEN NOT pending;
        IF coalesce(t.kind, 'sum') <> 'sum' THEN
            folded := folded + tallyd.rollup_into_kind(slots, t.counter, t.target::regclass,
                                                       t.key_column, t.count_column, t.key_type,
                                                       t.kind, batch_rows);
            CONTINUE;
        END IF;
        IF coalesce(t.span, 'all') <> 'all' THEN
            folded := folded + tallyd.rollup_into_windows(w, batch_rows);
            CONTINUE;
        END IF;
        BEGIN
            n := tallyd.rollup_into_shard(slots, rejects, t.counter, t.target::regclass,
                                          t.key_column, t.count_column, t.key_type, batch_rows,
                                          NULL);
        EXCEPTION WHEN numeric_value_out_of_range THEN
            -- As V7: key by key, among the keys that have a row in the target, in key order.
            n := 0;
            FOR k IN EXECUTE format($q$
                SELECT DISTINCT s.key FROM %1$s s
                WHERE s.counter = $1
                  AND NOT EXISTS (SELECT 1 FROM %2$s j WHERE j.counter = s.counter AND j.key = s.key)
                  AND EXISTS (SELECT 1 FROM %3$s u WHERE u.%4$I = s.key::%5$s)
                ORDER BY s.key
                LIMIT $2
            $q$, slots, rejects, t.target::regclass, t.key_column, t.key_type)
                USING t.counter, batch_rows
            LOOP
                BEGIN
                    n := n + tallyd.rollup_into_shard(slots, rejects, t.counter,
                                                      t.target::regclass, t.key_column,
                                                      t.count_column, t.key_type, batch_rows,
                                                      k.key);
                EXCEPTION WHEN numeric_value_out_of_range THEN
                    EXECUTE format($q$
                        INSERT INTO %1$s AS j (counter, key, total) VALUES ($1, $2, NULL)
                        ON CONFLICT (counter, key) DO UPDATE SET total = NULL, rejected_at = now()
                    $q$, rejects) USING t.counter, k.key;
                END;
            END LOOP;
        END;
        folded := folded + n;
    END LOOP;
    RETURN folded;
END
$function$;
