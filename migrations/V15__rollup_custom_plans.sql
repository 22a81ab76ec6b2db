-- The rollup's steps planned for their arguments at every call (issue 32, the all-time rollup
-- under sustained new keys; docs/design.md, "Rollup"). V14's step functions run their claim as a
-- PL/pgSQL statement, whose plan PostgreSQL caches: after five calls it may keep a generic plan,
-- planned without the cursor or the batch size, and for the claim (`key > $after ORDER BY key
-- LIMIT $batch`) the generic plan it chose under load reads every slot row of the counter (a
-- bitmap scan), probes each one's summary row, sorts them all (spilling to disk) and only then
-- keeps the batch: 26 s for an 8,000-row step over 2.3 million slot rows, where the plan for the
-- actual arguments (an ordered index range from the cursor) takes 0.5 s. Its cost grows with the
-- backlog, the pace halves the batch of every slow step, and an all-time counter given 30,000 new
-- keys a second stopped folding altogether (study/rollfast/README.md, waits.py).
--
-- A plan for the arguments costs well under a millisecond per statement, a step's statements run
-- once per step over up to 50,000 rows: every statement the two step entry points run (and those
-- of the functions they call, which inherit the setting) is planned for its arguments.
ALTER FUNCTION tallyd.rollup_summary(text, text, text, integer) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION tallyd.rollup_target(text, text, integer) SET plan_cache_mode = force_custom_plan;
