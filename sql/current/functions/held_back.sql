-- tallyd.held_back: last changed by migrations/V18__rollup_into_on_add.sql (changed in V11, V13, V18)
-- Read-only copy: change it by a new migration, then here (migrations/README.md);
-- tests/schema.rs compares the two.
--
-- Keys of insert_missing targets held back by a foreign key (tallyd.rollup_held), per counter: how
-- many, their slot rows waiting, and the first key in key order with the error of its last try. A
-- held key with no slot rows left (deleted by retention or by hand) is not counted; its next retry
-- deletes it. Counted key by key in PL/pgSQL (V13): V11's SQL function counted in a LATERAL
-- subquery over tallyd.slots, which Citus cannot plan, so every rollup with a rollup_into counter
-- failed there; each count here names one key, which Citus routes to its shard. held_since (V18):
-- when the counter's longest-held key was first held.
CREATE OR REPLACE FUNCTION tallyd.held_back()
 RETURNS TABLE(counter text, keys bigint, slot_rows bigint, example_key text, cause text, held_since timestamp with time zone)
 LANGUAGE plpgsql
 STABLE
AS $function$
DECLARE
    h record;
    n bigint;
BEGIN
    FOR h IN
        SELECT x.counter AS c, x.key AS k, x.cause AS why, x.held_at AS at, r.span
        FROM tallyd.rollup_held x
        JOIN tallyd.rollup_targets r ON r.counter = x.counter
        ORDER BY x.counter, x.key
    LOOP
        SELECT count(*) INTO n FROM tallyd.slots s
        WHERE s.counter = h.c AND s.key = h.k AND s.span = h.span;
        -- A held key with no slot rows left is not counted (its next retry deletes it).
        CONTINUE WHEN n = 0;
        IF counter IS DISTINCT FROM h.c THEN
            IF counter IS NOT NULL THEN
                RETURN NEXT;
            END IF;
            -- The first key of the counter in key order, and the error of its last try.
            counter := h.c;
            keys := 0;
            slot_rows := 0;
            example_key := h.k;
            cause := h.why;
            held_since := h.at;
        END IF;
        held_since := least(held_since, h.at);
        keys := keys + 1;
        slot_rows := slot_rows + n;
    END LOOP;
    IF counter IS NOT NULL THEN
        RETURN NEXT;
    END IF;
END
$function$;
