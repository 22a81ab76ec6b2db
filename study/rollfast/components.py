#!/usr/bin/env python3
"""What one step of today's rollup costs, statement by statement: each of the statements
tallyd.rollup(1000) runs for the issue's windowed target, repeated REPS times in transactions
that roll back (so the table stays as it is), measured as the stepping backend's own CPU (/proc).

  components.py [--fold-first N] [--hold-horizon] [--reps 20]
  --fold-first N: first fold N rows (N/1000 committed steps of today's statement, which take
                  rows from the start of the heap), leaving N dead rows behind, as the steps of a
                  catch-up do
  --hold-horizon: measure while another session holds a transaction id open (as a flush
                  transaction does while the rollup runs beside it): dead rows then stay
                  unprunable and their index entries unkillable
Run on the table state of `fold.py restore` (400k slot rows of vd, as the flush left them).
"""
import json, os, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e import Psql  # noqa: E402
from fold import proc_cpu  # noqa: E402

TARGET = "(SELECT x FROM jsonb_array_elements(tallyd.rollup_targets_json()) x WHERE x->>'counter' = 'vd')"
PARTS = [
    ('whole step: tallyd.rollup(1000)', 'SELECT tallyd.rollup(1000)'),
    ('rollup_targets_json()', 'SELECT tallyd.rollup_targets_json()'),
    ('rollup_fold_own (all-time fold: finds nothing)', "SELECT tallyd.rollup_fold_own(1000, ARRAY[E'vd\\nday'])"),
    ('pending check: EXISTS slot row of vd', "SELECT EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = 'vd')"),
    ('rollup_into_windows (held keys + window statement, dynamic)', f'SELECT tallyd.rollup_into_windows({TARGET}, 1000)'),
    ('window statement, static (rollperf.step_v11_static)', 'SELECT rollperf.step_v11_static(1000)'),
    ('window statement, static, no advisory locks', 'SELECT rollperf.step_v11_nolock(1000)'),
    ('prototype: set-based step with key cursor', 'SELECT rollperf.step_set_cursor(1000)'),
]


def arg(name, default=None, cast=str):
    return cast(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    reps = arg('--reps', 20, int)
    p = Psql()
    n = arg('--fold-first', 0, int)
    holder = None
    if '--hold-horizon' in sys.argv:
        # held from before the rows are folded, as a flush transaction that began before them
        holder = Psql()
        holder.q('BEGIN')
        holder.q('SELECT txid_current()')
    for _ in range(n // 1000):
        p.q('SELECT rollperf.step_v11_static(1000)')
    pid = int(p.one('SELECT pg_backend_pid()'))
    out = {'fold_first': n, 'hold_horizon': holder is not None, 'reps': reps,
           'slot_rows': int(p.one('SELECT count(*) FROM tallyd.slots')), 'ms_cpu_per_call': {}}
    for name, sql in PARTS:
        p.q('BEGIN'); p.q(sql); p.q('ROLLBACK')  # warm: plans, hint bits
        c0 = proc_cpu(pid)
        t0 = time.monotonic()
        for _ in range(reps):
            p.q('BEGIN')
            p.q(sql)
            p.q('ROLLBACK')
        out['ms_cpu_per_call'][name] = round((proc_cpu(pid) - c0) / reps * 1000, 1)
    out['load1'] = os.getloadavg()[0]
    if holder:
        holder.q('ROLLBACK')
    print(json.dumps(out, indent=1))


if __name__ == '__main__':
    main()
