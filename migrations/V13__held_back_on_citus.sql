-- tallyd.held_back() (V11) on Citus. V11 wrote it as an SQL function counting each held key's
-- slot rows in a LATERAL subquery over tallyd.slots; Citus cannot plan that ("cannot perform
-- distributed planning on this query because parameterized queries for SQL functions referencing
-- distributed tables are not supported", and as a plain query: "Aggregates without group by are
-- currently unsupported when a lateral subquery references a column from complex subqueries,
-- CTEs or local tables"), so every `tallyd rollup` and every rollup pass of a daemon with a
-- rollup_into counter failed on Citus, even with tallyd.rollup_held empty (it always is there:
-- windowed rollup_into is refused on Citus). Same result, now counted key by key: each count
-- names one key, which Citus routes to its shard, and tallyd.rollup_held holds few keys (those
-- whose row a foreign key refuses), each counted through the primary key's index.
CREATE OR REPLACE FUNCTION tallyd.held_back()
RETURNS TABLE (counter text, keys bigint, slot_rows bigint, example_key text, cause text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h record;
    n bigint;
BEGIN
    FOR h IN
        SELECT x.counter AS c, x.key AS k, x.cause AS why, r.span
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
        END IF;
        keys := keys + 1;
        slot_rows := slot_rows + n;
    END LOOP;
    IF counter IS NOT NULL THEN
        RETURN NEXT;
    END IF;
END
$$;
