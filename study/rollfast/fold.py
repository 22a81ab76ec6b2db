#!/usr/bin/env python3
"""The rollup alone: folds tallyd.slots with one step statement until a step folds fewer rows
than its batch, and reports rows/s, server CPU per row (whole server, /proc) and the stepping
backend's own CPU per row and per step.

  fold.py snapshot                 keep tallyd.slots and version_downloads as they are now
  fold.py restore                  put them back (then VACUUM ANALYZE, CHECKPOINT)
  fold.py run STEP BATCH [--async] [--tag T]
      STEP: today | v11_static | v11_nolock | set | any SQL with %d for the batch size
            | v14 (tallyd.rollup_step of counter vd's target, V14, the cursor kept here as the
              daemon keeps it) | v14_summary (the same for its rows bound for tallyd.rollups)
      --async: SET synchronous_commit = off in the stepping session
"""
import json, os, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from servercpu import server_cpu  # noqa: E402
from e2e import Psql, postmaster  # noqa: E402

TCK = os.sysconf('SC_CLK_TCK')
STEPS = {
    'today': 'SELECT tallyd.rollup(%d)',
    'v11_static': 'SELECT rollperf.step_v11_static(%d)',
    'v11_nolock': 'SELECT rollperf.step_v11_nolock(%d)',
    'set': 'SELECT rollperf.step_set(%d)',
    'set_cursor': 'SELECT rollperf.step_set_cursor(%d)',
    'set_cursor_adv': 'SELECT rollperf.step_set_cursor(%d, true)',
    'alltime_cursor': 'SELECT rollperf.step_alltime_cursor(%d)',
}


def proc_cpu(pid):
    with open(f'/proc/{pid}/stat') as f:
        s = f.read()
    x = s[s.rindex(')') + 2:].split()
    return (int(x[11]) + int(x[12])) / TCK


def main():
    cmd = sys.argv[1]
    p = Psql()
    if cmd == 'snapshot':
        p.q('DROP TABLE IF EXISTS rollperf.slots_snap, rollperf.vd_snap')
        p.q('CREATE SCHEMA IF NOT EXISTS rollperf')
        p.q('CREATE TABLE rollperf.slots_snap AS SELECT * FROM tallyd.slots')
        p.q('CREATE TABLE rollperf.vd_snap AS SELECT * FROM public.version_downloads')
        print(p.q('SELECT (SELECT count(*) FROM rollperf.slots_snap), (SELECT count(*) FROM rollperf.vd_snap)'))
        return
    if cmd == 'restore':
        p.q('TRUNCATE tallyd.slots, tallyd.rollups, tallyd.rollup_held, tallyd.rollup_rejects, public.version_downloads')
        p.q('INSERT INTO tallyd.slots SELECT * FROM rollperf.slots_snap')
        p.q('INSERT INTO public.version_downloads SELECT * FROM rollperf.vd_snap')
        p.q('VACUUM ANALYZE tallyd.slots')
        p.q('VACUUM ANALYZE public.version_downloads')
        p.q('CHECKPOINT')
        return
    assert cmd == 'run'
    step = STEPS.get(sys.argv[2], sys.argv[2])
    batch = int(sys.argv[3])
    tag = sys.argv[sys.argv.index('--tag') + 1] if '--tag' in sys.argv else sys.argv[2]
    if '--async' in sys.argv:
        p.q('SET synchronous_commit = off')
    bpid = int(p.one('SELECT pg_backend_pid()'))
    p.q('SELECT pg_stat_statements_reset()')
    before_rows = int(p.one('SELECT count(*) FROM tallyd.slots'))
    pm = postmaster()
    s0, b0, t0 = server_cpu(pm), proc_cpu(bpid), time.monotonic()
    wal0 = int(p.one("SELECT pg_current_wal_lsn() - '0/0'"))
    folded = steps = 0
    slow = []
    cursor = ''
    while True:
        a = time.monotonic()
        if step in ('v14', 'v14_summary'):
            into = 'true' if step == 'v14' else 'false'
            n, last = p.q(f"SELECT folded, coalesce(last_key, '') FROM tallyd.rollup_step('vd', 'sum', {into}, '{cursor}', {batch})")[0]
            n, cursor = int(n), last
            folded += n
            steps += 1
            slow.append(time.monotonic() - a)
            if not cursor:
                break
            continue
        n = int(p.one(step % batch))
        slow.append(time.monotonic() - a)
        folded += n
        steps += 1
        if n < batch:
            break
    t1, b1, s1 = time.monotonic(), proc_cpu(bpid), server_cpu(pm)
    wal1 = int(p.one("SELECT pg_current_wal_lsn() - '0/0'"))
    left = int(p.one('SELECT count(*) FROM tallyd.slots'))
    slow.sort()
    out = {
        'tag': tag, 'batch': batch, 'async': '--async' in sys.argv, 'rows_before': before_rows,
        'folded': folded, 'left': left, 'steps': steps, 'wall_s': round(t1 - t0, 2),
        'rows_per_s': round(folded / (t1 - t0)),
        'server_cpu_s': round(s1 - s0, 2), 'backend_cpu_s': round(b1 - b0, 2),
        'server_us_per_row': round((s1 - s0) / max(folded, 1) * 1e6, 2),
        'backend_us_per_row': round((b1 - b0) / max(folded, 1) * 1e6, 2),
        'server_busy': round((s1 - s0) / (t1 - t0), 2),
        'step_ms_p50': round(slow[len(slow) // 2] * 1000, 1),
        'step_ms_p90': round(slow[int(len(slow) * 0.9)] * 1000, 1),
        'wal_bytes_per_row': round((wal1 - wal0) / max(folded, 1)),
        'load1': os.getloadavg()[0],
    }
    print(json.dumps(out))


if __name__ == '__main__':
    main()
