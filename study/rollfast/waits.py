#!/usr/bin/env python3
"""Samples, every 100 ms for SECONDS, what each backend of the database is doing (wait event or
CPU), by role (the rollup's step, a flush, other), and the nested statements' time from
pg_stat_statements (pg.sh start with STATS=all): where the rollup step's time goes under load.

  waits.py SECONDS [--reset]
"""
import collections, json, os, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e import Psql  # noqa: E402

secs = float(sys.argv[1])
p = Psql()
if '--reset' in sys.argv:
    p.q("SELECT pg_stat_statements_reset()")
counts = collections.defaultdict(collections.Counter)
n = 0
t_end = time.monotonic() + secs
while time.monotonic() < t_end:
    for role, w in p.q("""SELECT CASE WHEN query LIKE '%rollup_step%' THEN 'rollup'
                                      WHEN query LIKE '%slots%' OR query LIKE '%flushes%' THEN 'flush'
                                      ELSE 'other' END,
                                 coalesce(wait_event_type || ':' || wait_event, 'CPU')
                          FROM pg_stat_activity
                          WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()"""):
        counts[role][w] += 1
    n += 1
    time.sleep(0.1)
print(json.dumps({'samples': n, 'roles': {r: dict(c.most_common()) for r, c in counts.items()}}))
for r in p.q("""SELECT calls, round(total_exec_time::numeric) AS ms, rows,
                       round((total_exec_time / greatest(calls, 1))::numeric, 2) AS ms_per_call,
                       shared_blks_hit + shared_blks_read AS blks, shared_blks_dirtied,
                       regexp_replace(left(query, 110), '\\s+', ' ', 'g')
                FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 25"""):
    print('\t'.join(r))
