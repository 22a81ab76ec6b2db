#!/usr/bin/env python3
"""Replays rollperf.flights (flights.py) as flush transactions on WORKERS sessions, each flight
`BEGIN; SET LOCAL tallyd.flushing = on; SELECT rollperf.flush(f, w, MODE); COMMIT` (durable
commit), optionally with a rollup session stepping beside them; then (--drain) the rollup runs
until tallyd.slots holds no row of the counter. Reports server CPU (whole server, /proc),
rows/s, and the time until the application's table (or tallyd.rollups) holds every event.

  flushsim.py MODE [--rollup STEP --batch N [--async] [--pace-ms MS]] [--drain] [--workers 2]
              [--counter vd --span day] [--tag T]
  MODE: none | slots | direct | direct_insert | rollups (proto_flush.sql)
  STEP: as fold.py (today | v11_static | v11_nolock | set | SQL with %d)
"""
import json, os, sys, threading, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from servercpu import server_cpu  # noqa: E402
from e2e import Psql, postmaster  # noqa: E402
from fold import STEPS, proc_cpu  # noqa: E402
from e2e import sampler  # noqa: E402


def arg(name, default=None, cast=str):
    return cast(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    mode = sys.argv[1]
    workers = arg('--workers', 2, int)
    counter = arg('--counter', 'vd')
    span = arg('--span', 'day')
    step = arg('--rollup')
    step = STEPS.get(step, step)
    batch = arg('--batch', 1000, int)
    pace = arg('--pace-ms', 0, int) / 1000
    p = Psql()
    p.q('TRUNCATE tallyd.slots, tallyd.rollups, public.version_downloads, rollperf.ledger')
    if mode == 'append':
        p.q('TRUNCATE rollperf.slots_append')
    if '--prefill' in sys.argv:
        # the steady state of a day: every (key, day) row exists (with 0 downloads)
        p.q("""INSERT INTO public.version_downloads (version_id, date, downloads)
               SELECT DISTINCT key::bigint, (now() AT TIME ZONE 'Europe/Berlin')::date, 0 FROM rollperf.flights""")
        p.q("""INSERT INTO tallyd.rollups (counter, key, span, win, count, first_seen, last_seen)
               SELECT DISTINCT 'vd', key, 'all', '-infinity'::timestamptz, 0, now(), now() FROM rollperf.flights""")
    p.q('VACUUM ANALYZE tallyd.slots'); p.q('VACUUM ANALYZE public.version_downloads'); p.q('VACUUM ANALYZE tallyd.rollups')
    p.q('CHECKPOINT')
    p.q('SELECT pg_stat_statements_reset()')
    flights = int(p.one('SELECT max(flight) + 1 FROM rollperf.flights'))
    events = int(p.one('SELECT sum(n) FROM rollperf.flights'))
    frows = int(p.one('SELECT count(*) FROM rollperf.flights'))
    st0 = p.q("SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables WHERE relid = 'tallyd.slots'::regclass")[0]
    pm = postmaster()
    sessions = [Psql() for _ in range(workers)]
    bpids = [int(s.one('SELECT pg_backend_pid()')) for s in sessions]
    roll = Psql() if step else None
    if os.environ.get('AUTO_EXPLAIN_MS'):
        # the plans of slow statements (nested ones too) in the server log, without ANALYZE
        for s in sessions + ([roll] if roll else []):
            s.q("LOAD 'auto_explain'")
            s.q(f"SET auto_explain.log_min_duration = {os.environ['AUTO_EXPLAIN_MS']}")
            s.q('SET auto_explain.log_nested_statements = on')
    if roll and '--async' in sys.argv:
        roll.q('SET synchronous_commit = off')
    rpid = int(roll.one('SELECT pg_backend_pid()')) if roll else None
    done = threading.Event()
    stats = {'folded': 0, 'steps': 0, 'rollup_cpu': 0.0}

    errors = []

    def flusher(i):
        s = sessions[i]
        for f in range(flights):
          try:
            s.q(f"BEGIN; SET LOCAL tallyd.flushing = on; SELECT rollperf.flush({f}, {i}, '{mode}', '{counter}', '{span}'); COMMIT")
          except Exception as e:  # noqa: E722
            errors.append(e)
            s.q('ROLLBACK')
            return

    def roller():
        while not done.is_set():
            n = int(roll.one(step % batch))
            stats['folded'] += n
            stats['steps'] += 1
            if n < batch:
                time.sleep(pace or 0.05)
            elif pace:
                time.sleep(pace)

    samples = {'activity': {}, 'waiting_locks': {}, 'samples': 0}
    sstop = threading.Event()
    if '--sample-waits' in sys.argv:
        p.q('SELECT pg_stat_statements_reset()')
        sth = threading.Thread(target=sampler, args=(sstop, samples))
        sth.start()
    s0, t0 = server_cpu(pm), time.monotonic()
    b0 = [proc_cpu(b) for b in bpids]
    r0 = proc_cpu(rpid) if roll else 0
    ths = [threading.Thread(target=flusher, args=(i,)) for i in range(workers)]
    for t in ths:
        t.start()
    rt = threading.Thread(target=roller) if roll else None
    if rt:
        rt.start()
    for t in ths:
        t.join()
    if errors:
        sys.exit(f'flush failed: {errors[0]}')
    t1, s1 = time.monotonic(), server_cpu(pm)
    b1 = [proc_cpu(b) for b in bpids]
    done.set()
    if rt:
        rt.join()
    folded_during = stats['folded']
    t2, s2 = time.monotonic(), server_cpu(pm)
    if '--drain' in sys.argv and roll:
        while True:
            n = int(roll.one(step % batch))
            stats['folded'] += n
            stats['steps'] += 1
            if n < batch and int(p.one(f"SELECT count(*) FROM tallyd.slots WHERE counter = '{counter}'")) == 0:
                break
            if n < batch:
                time.sleep(0.05)
    t3, s3 = time.monotonic(), server_cpu(pm)
    r1 = proc_cpu(rpid) if roll else 0
    st1 = p.q("SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relid = 'tallyd.slots'::regclass")[0]
    left = int(p.one(f"SELECT count(*) FROM tallyd.slots WHERE counter = '{counter}'"))
    if mode == 'append' and '--fold-partition' in sys.argv:
        # design (c): the closed partition folded whole and truncated
        c0, w0 = server_cpu(pm), time.monotonic()
        fp = int(p.one('SELECT rollperf.fold_partition()'))
        out_fold = {'partition_rows_folded': fp, 'fold_wall_s': round(time.monotonic() - w0, 2),
                    'fold_server_cpu_s': round(server_cpu(pm) - c0, 2),
                    'fold_us_per_row': round((server_cpu(pm) - c0) / max(fp, 1) * 1e6, 2)}
    else:
        out_fold = {}
    if span == 'all':
        target = int(p.one(f"SELECT coalesce(sum(count), 0) FROM tallyd.rollups WHERE counter = '{counter}'"))
    else:
        target = int(p.one('SELECT coalesce(sum(downloads), 0) FROM public.version_downloads'))
    slot_sum = int(p.one(f"SELECT coalesce(sum(count), 0) FROM tallyd.slots WHERE counter = '{counter}'"))
    if mode == 'append':
        slot_sum += int(p.one('SELECT coalesce(sum(count), 0) FROM rollperf.slots_append'))
    out = {
        'tag': arg('--tag', mode), 'mode': mode, 'rollup': arg('--rollup'), 'batch': batch,
        'async': '--async' in sys.argv, 'flights': flights, 'flight_rows': frows, 'events': events,
        'exact': target + slot_sum == events,
        'flush_wall_s': round(t1 - t0, 2), 'flush_rows_per_s': round(frows / (t1 - t0)),
        'server_cpu_flush_phase_s': round(s1 - s0, 2),
        'server_us_per_flight_row_flush_phase': round((s1 - s0) / frows * 1e6, 2),
        'flush_backends_cpu_s': round(sum(b1) - sum(b0), 2),
        'flush_backend_us_per_row': round((sum(b1) - sum(b0)) / frows * 1e6, 2),
        'rollup_folded_during_flush': folded_during,
        'rollup_folded_total': stats['folded'], 'rollup_steps': stats['steps'],
        'rollup_backend_cpu_s': round(r1 - r0, 2),
        'drain_wall_s': round(t3 - t2, 2), 'drain_server_cpu_s': round(s3 - s2, 2),
        'end_to_end_wall_s': round(t3 - t0, 2), 'end_to_end_server_cpu_s': round(s3 - s0, 2),
        'server_us_per_event': round((s3 - s0) / events * 1e6, 3),
        'in_target': target, 'in_slots': slot_sum, 'slot_rows_left': left,
        'slots_ins': int(st1[0]) - int(st0[0]), 'slots_upd': int(st1[1]) - int(st0[1]),
        'slots_hot_upd': int(st1[2]) - int(st0[2]), 'slots_del': int(st1[3]) - int(st0[3]),
        'slots_dead': int(st1[5]),
        'load1': os.getloadavg()[0],
    }
    out.update(out_fold)
    if '--sample-waits' in sys.argv:
        sstop.set()
        sth.join()
        out['wait_samples'] = samples
        out['top_statements'] = p.q("""SELECT calls, round(total_exec_time::numeric), rows,
            left(regexp_replace(query, '\\s+', ' ', 'g'), 100) FROM pg_stat_statements
            ORDER BY total_exec_time DESC LIMIT 12""")
    print(json.dumps(out))
    for s in sessions:
        s.close()


if __name__ == '__main__':
    main()
