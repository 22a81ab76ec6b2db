#!/usr/bin/env python3
"""End to end, the issue's recipe (issue 32): a counter `vd` (bigint keys, window day,
Europe/Berlin) rolled into version_downloads (insert_missing) by the daemon's own rollup;
CLIENTS stream connections each send EVENTS lines `vd <key>` (keys uniform below KEYS) and
`!sync`; the clock stops when sum(downloads) reaches CLIENTS*EVENTS. Server CPU from /proc
(the postmaster and its children, servercpu.py). Prints one JSON line of results.

  e2e.py [--rollup on|off] [--batch-rows N] [--interval-ms N] [--alltime] [--fk]
         [--sample-waits] [--tallyd PATH] [--tag NAME]

The cluster is study/rollperf/pg.sh's (start it first). --rollup off measures the flush alone
(clock stops when every event is committed to tallyd.slots). --alltime: an all-time counter
into tallyd.rollups instead (clock: sum over tallyd.rollups). --sample-waits: a second session
samples pg_stat_activity wait events and pg_locks every 50 ms (costs server CPU: not for the
CPU figures)."""
import argparse, json, os, random, re, shutil, socket, subprocess, sys, threading, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from servercpu import server_cpu, children  # noqa: E402

ROOT = os.environ.get('ROLLPERF_ROOT', '/tmp/rollperf')
SOCK = f'{ROOT}/sock'
PORT = int(os.environ.get('ROLLPERF_PORT', '55432'))
DB = os.environ.get('ROLLPERF_DB', 'postgres')
CONNINFO = f'host={SOCK} port={PORT} user=postgres dbname={DB}'


class Psql:
    """One persistent psql session: each query's rows as lists of strings."""

    def __init__(self):
        self.p = subprocess.Popen(['psql', '-X', '-At', '-F', '\t', '-v', 'ON_ERROR_STOP=0', '-q',
                                   CONNINFO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1)

    def q(self, sql):
        self.p.stdin.write(sql.rstrip().rstrip(';') + ';\n\\echo __END__\n')
        self.p.stdin.flush()
        rows = []
        for line in self.p.stdout:
            line = line.rstrip('\n')
            if line == '__END__':
                return rows
            if line.startswith('ERROR') or line.startswith('psql:'):
                raise RuntimeError(line)
            rows.append(line.split('\t'))
        raise RuntimeError('psql ended')

    def one(self, sql):
        r = self.q(sql)
        return r[0][0] if r else None

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def psql(sql):
    subprocess.run(['psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', CONNINFO, '-c', sql], check=True,
                   stdout=subprocess.DEVNULL)


def postmaster():
    with open(f'{ROOT}/pg/postmaster.pid') as f:
        return int(f.readline())


def load(clients, events, keys, seed=32):
    """Per client, a file of `vd <key>` lines (cached)."""
    bufs = []
    for i in range(clients):
        path = f'{ROOT}/load-{seed}-{keys}-{events}-{i}.txt'
        if not os.path.exists(path):
            rnd = random.Random(seed * 1000 + i)
            with open(path + '.tmp', 'w') as f:
                f.write(''.join(f'vd {rnd.randrange(keys)}\n' for _ in range(events)))
            os.rename(path + '.tmp', path)
        with open(path, 'rb') as f:
            bufs.append(f.read())
    return bufs


def distinct_keys(bufs):
    path = f'{ROOT}/distinct-{len(bufs)}-{len(bufs[0])}.txt'
    if os.path.exists(path):
        return int(open(path).read())
    s = set()
    for b in bufs:
        s.update(b.split(b'\n'))
    s.discard(b'')
    open(path, 'w').write(str(len(s)))
    return len(s)


TABLE = """
DROP TABLE IF EXISTS public.version_downloads;
DROP TABLE IF EXISTS public.versions;
CREATE TABLE public.version_downloads (
    version_id bigint NOT NULL,
    date date NOT NULL,
    downloads bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (version_id, date));
"""
FK = """
CREATE TABLE public.versions (id bigint PRIMARY KEY);
INSERT INTO public.versions SELECT generate_series(0, {keys});
ALTER TABLE public.version_downloads ADD FOREIGN KEY (version_id) REFERENCES public.versions (id);
ANALYZE public.versions;
"""


def config(d, port, a):
    window = '' if a.alltime else '''window = "day"
time_zone = "Europe/Berlin"
'''
    into = '' if a.alltime else '''[counters.rollup_into]
table = "public.version_downloads"
key_column = "version_id"
window_column = "date"
column = "downloads"
insert_missing = true
'''
    return f'''[daemon]
data_dir = "{d}"
instance_id = "rollperf"
[database]
url = "{CONNINFO}"
[listen]
socket = "{d}/tallyd.sock"
datagram_socket = ""
[flush]
{f"connections = {a.flush_connections}" if a.flush_connections else ""}
[rollup]
enabled = {"true" if a.rollup == "on" else "false"}
{f"interval_ms = {a.interval_ms}" if a.interval_ms else ""}
{f"batch_rows = {a.batch_rows}" if a.batch_rows else ""}
[metrics]
listen = "127.0.0.1:{port}"
status_top_keys = 0
[log]
level = "warn"
[[counters]]
name = "vd"
key_type = "bigint"
{window}{into}'''


def metrics(port):
    out = {}
    try:
        text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=2).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith('#'):
            continue
        m = re.match(r'(tallyd_[a-z_]+)(\{[^}]*\})?\s+(\S+)', line)
        if m:
            out[m.group(1) + (m.group(2) or '')] = float(m.group(3))
    return out


def msum(m, name):
    return sum(v for k, v in m.items() if k == name or k.startswith(name + '{'))


def send(path, buf, res, i, start):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    start.wait()
    s.sendall(buf)
    s.sendall(b'!sync\n')
    reply = b''
    while not reply.endswith(b'\n'):
        reply += s.recv(100)
    res[i] = (time.monotonic(), reply.decode().strip())
    s.close()


def table_stats(p, rel):
    r = p.q(f"""SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_live_tup, n_dead_tup,
                       autovacuum_count, autoanalyze_count,
                       pg_relation_size('{rel}'), pg_indexes_size('{rel}')
                FROM pg_stat_user_tables WHERE relid = '{rel}'::regclass""")
    keys = ['ins', 'upd', 'hot_upd', 'del', 'live', 'dead', 'autovacuums', 'autoanalyzes',
            'heap_bytes', 'index_bytes']
    return dict(zip(keys, map(int, r[0]))) if r else {}


def sampler(stop, out):
    """Every 50 ms: what each client backend waits on, and lock requests not granted."""
    p = Psql()
    while not stop.is_set():
        for row in p.q("""SELECT coalesce(application_name, ''), state, coalesce(wait_event_type, 'CPU'),
                                 coalesce(wait_event, ''), left(query, 40)
                          FROM pg_stat_activity
                          WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
                            AND state <> 'idle'"""):
            key = ' | '.join(row[:4]) + ' | ' + row[4].replace('\n', ' ')
            out['activity'][key] = out['activity'].get(key, 0) + 1
        for row in p.q("""SELECT locktype, mode, count(*) FROM pg_locks WHERE NOT granted
                          GROUP BY 1, 2"""):
            key = f'{row[0]} {row[1]}'
            out['waiting_locks'][key] = out['waiting_locks'].get(key, 0) + int(row[2])
        out['samples'] += 1
        time.sleep(0.1)
    p.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rollup', default='on')
    ap.add_argument('--batch-rows', type=int)
    ap.add_argument('--interval-ms', type=int)
    ap.add_argument('--flush-connections', type=int)
    ap.add_argument('--alltime', action='store_true')
    ap.add_argument('--fk', action='store_true')
    ap.add_argument('--sample-waits', action='store_true')
    ap.add_argument('--clients', type=int, default=4)
    ap.add_argument('--events', type=int, default=1_000_000)
    ap.add_argument('--keys', type=int, default=400_000)
    ap.add_argument('--tallyd', default=os.path.join(HERE, '../../target/release/tallyd'))
    ap.add_argument('--tag', default='e2e')
    ap.add_argument('--keep', action='store_true', help='leave the daemon data dir')
    ap.add_argument('--setup-sql', help='SQL run after migration, before the load')
    ap.add_argument('--proto-step', help='instead of the daemon\'s rollup, a session stepping this '
                    'fold.py STEP continuously (a step folding fewer than --proto-batch rows is '
                    'followed by --proto-idle-ms of sleep)')
    ap.add_argument('--proto-batch', type=int, default=1000)
    ap.add_argument('--proto-idle-ms', type=int, default=100)
    ap.add_argument('--proto-async', action='store_true', help='synchronous_commit = off for the steps')
    a = ap.parse_args()
    if a.proto_step:
        a.rollup = 'proto'

    total = a.clients * a.events
    bufs = load(a.clients, a.events, a.keys)
    nkeys = distinct_keys(bufs)
    psql(TABLE + (FK.format(keys=a.keys) if a.fk else ''))
    psql("""DO $$ BEGIN IF to_regclass('tallyd.slots') IS NOT NULL THEN
              TRUNCATE tallyd.slots, tallyd.rollups, tallyd.flushes, tallyd.rollup_held,
                       tallyd.rollup_rejects, tallyd.instances;
            END IF; END $$""")
    d = f'{ROOT}/d-{a.tag}'
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    os.chmod(d, 0o700)
    port = random.randrange(20000, 30000)
    cfg = f'{d}/config.toml'
    open(cfg, 'w').write(config(d, port, a))
    log = open(f'{d}/tallyd.log', 'w')
    daemon = subprocess.Popen([a.tallyd, '--config', cfg, 'run'], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if os.path.exists(f'{d}/tallyd.sock') and metrics(port):
            break
        if daemon.poll() is not None:
            sys.exit(f'tallyd exited: {open(f"{d}/tallyd.log").read()}')
        time.sleep(0.1)
    if a.setup_sql:
        psql(open(a.setup_sql).read())
    p = Psql()
    p.q('CHECKPOINT')
    p.q("SELECT pg_stat_reset(), pg_stat_statements_reset()")
    time.sleep(0.6)  # the stats collector's reset lands before the "before" figures
    pm = postmaster()
    slots0 = table_stats(p, 'tallyd.slots')
    vd0 = table_stats(p, 'public.version_downloads')
    m0 = metrics(port)
    wal0 = int(p.one("SELECT pg_current_wal_lsn() - '0/0'"))
    poller_pid = int(p.one('SELECT pg_backend_pid()'))
    kids0 = children(pm)
    cpu0 = server_cpu(pm)
    self0 = os.times()
    samples = {'activity': {}, 'waiting_locks': {}, 'samples': 0}
    stop = threading.Event()
    if a.sample_waits:
        th = threading.Thread(target=sampler, args=(stop, samples))
        th.start()
    proto = {'rows': 0, 'steps': 0, 'cpu': 0.0, 'stop': threading.Event(), 'error': None}
    if a.proto_step:
        from fold import STEPS, proc_cpu
        step_sql = STEPS.get(a.proto_step, a.proto_step)
        stepper = Psql()
        if a.proto_async:
            stepper.q('SET synchronous_commit = off')
        spid = int(stepper.one('SELECT pg_backend_pid()'))

        def stepping():
            c0 = proc_cpu(spid)
            try:
                while not proto['stop'].is_set():
                    n = int(stepper.one(step_sql % a.proto_batch))
                    proto['rows'] += n
                    proto['steps'] += 1
                    if n < a.proto_batch:
                        time.sleep(a.proto_idle_ms / 1000)
            except Exception as e:  # noqa: BLE001
                proto['error'] = str(e)
            proto['cpu'] = proc_cpu(spid) - c0
        proto_thread = threading.Thread(target=stepping)
    start = threading.Barrier(a.clients + 1)
    res = [None] * a.clients
    threads = [threading.Thread(target=send, args=(f'{d}/tallyd.sock', bufs[i], res, i, start))
               for i in range(a.clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    if a.proto_step:
        proto_thread.start()
    if a.alltime:
        summ = "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.rollups WHERE counter = 'vd'"
    else:
        summ = 'SELECT coalesce(sum(downloads), 0)::bigint FROM public.version_downloads'
    committed_at = None
    trace = []
    last_m = 0
    last_rows, moved_at, asked_at = -1, 0, 0
    while True:
        now = time.monotonic()
        if committed_at is None or now - last_m > 1:
            m = metrics(port)
            if now - last_m > 1:
                trace.append((round(now - t0, 1), int(msum(m, 'tallyd_flush_events_total') - msum(m0, 'tallyd_flush_events_total')),
                              proto['rows'] if a.proto_step else
                              int(msum(m, 'tallyd_rollup_rows_total') - msum(m0, 'tallyd_rollup_rows_total'))))
                last_m = now
            if committed_at is None and msum(m, 'tallyd_flush_events_total') - msum(m0, 'tallyd_flush_events_total') >= total:
                committed_at = now
        if committed_at is not None:
            if a.rollup == 'off':
                done = committed_at
                break
            # Every event is committed; the table holds them all once no slot row of vd is
            # left. Asked only once the rollup's folded rows (its metric) have not moved for
            # 0.3 s: the question costs the server what a rollup claim costs (dead index
            # entries), too much to ask every 50 ms.
            if proto['error']:
                sys.exit(f'prototype step failed: {proto["error"]}')
            rows_now = proto['rows'] if a.proto_step else msum(metrics(port), 'tallyd_rollup_rows_total')
            if rows_now != last_rows:
                last_rows, moved_at = rows_now, now
            elif now - moved_at > 0.3 and now - asked_at > 1:
                asked = asked_at = time.monotonic()
                if p.one("SELECT EXISTS (SELECT 1 FROM tallyd.slots WHERE counter = 'vd')") == 'f':
                    stored = int(p.one(summ))
                    if stored != total:
                        sys.exit(f'NOT EXACT: {stored} of {total}')
                    done = moved_at
                    break
        if now - t0 > 900:
            sys.exit('timeout')
        time.sleep(0.1)
    cpu1 = server_cpu(pm)
    kids1 = children(pm)
    if a.proto_step:
        proto['stop'].set()
        proto_thread.join()
    self1 = os.times()
    stop.set()
    if a.sample_waits:
        th.join()
    for t in threads:
        t.join()
    m1 = metrics(port)
    wal1 = int(p.one("SELECT pg_current_wal_lsn() - '0/0'"))
    slots1 = table_stats(p, 'tallyd.slots')
    vd1 = table_stats(p, 'public.version_downloads')
    # Who used the server's CPU during the run: each live process's CPU over the run, by role
    # (the tallyd connections told apart by their last statement), the rest (backends that
    # exited, autovacuum workers) as 'exited or short-lived'.
    roles = {int(r[0]): r[1] for r in p.q("""SELECT pid, CASE
            WHEN backend_type <> 'client backend' THEN backend_type
            WHEN pid = pg_backend_pid() THEN 'harness poller'
            WHEN query ILIKE '%rollperf.step%' THEN 'prototype rollup'
            WHEN query ILIKE '%rollup%' OR query ILIKE '%held_back%' OR query ILIKE '%unmatched%'
              OR query ILIKE '%pg_stat_user_tables%' OR query ILIKE '%rollup_rejects%' THEN 'tallyd rollup'
            WHEN query ILIKE '%record_flush%' OR query ILIKE 'COMMIT%' OR query ILIKE '%tallyd.slots%' THEN 'tallyd flush'
            ELSE 'other: ' || left(query, 30) END FROM pg_stat_activity""")}
    procs = {}
    for pid, (cmd, cpu) in kids1.items():
        used = cpu - kids0.get(pid, (None, 0))[1]
        role = roles.get(pid, 'autovacuum worker' if 'autovacuum worker' in cmd else cmd[:40])
        procs[role] = round(procs.get(role, 0) + used, 2)
    procs['exited or short-lived'] = round((cpu1 - cpu0) - sum(procs.values()), 2)
    # exactness
    if a.alltime:
        ex = p.q("SELECT count(*), sum(count) FROM tallyd.totals WHERE counter = 'vd'")
    else:
        ex = p.q("""SELECT count(DISTINCT version_id), sum(downloads) FROM public.version_downloads""")
    stmts = p.q("""SELECT calls, round(total_exec_time::numeric, 1), round(total_plan_time::numeric, 1), rows,
                          shared_blks_hit + shared_blks_read, wal_bytes, left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
                   FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 15""")
    daemon.terminate()
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
    p.close()

    def dm(name):
        return msum(m1, name) - msum(m0, name)
    out = {
        'tag': a.tag, 'rollup': a.rollup, 'batch_rows': a.batch_rows, 'interval_ms': a.interval_ms,
        'alltime': a.alltime, 'fk': a.fk, 'events': total, 'keys': nkeys,
        'replies': sorted({r[1] for r in res}),
        'wall_s': round(done - t0, 2),
        'events_per_s': round(total / (done - t0)),
        'committed_s': round(committed_at - t0, 2) if committed_at else None,
        'ingest_s': round(max(r[0] for r in res) - t0, 2),
        'server_cpu_s': round(cpu1 - cpu0, 2),
        'server_cpu_per_Mevent_s': round((cpu1 - cpu0) / total * 1e6, 2),
        'harness_cpu_s': round((self1[0] + self1[1]) - (self0[0] + self0[1]), 2),
        'server_cpu_by_role_s': procs,
        'server_cpu_without_poller_s': round(cpu1 - cpu0 - procs.get('harness poller', 0), 2),
        'wal_MB': round((wal1 - wal0) / 1e6, 1),
        'flush_rows': dm('tallyd_flush_rows_total'), 'flushes': dm('tallyd_flushes_total'),
        'flush_s': round(dm('tallyd_flush_duration_seconds_sum'), 2),
        'flush_retries': dm('tallyd_flush_retries_total'), 'flush_errors': dm('tallyd_flush_errors_total'),
        'rollup_rows': dm('tallyd_rollup_rows_total'), 'rollup_runs': dm('tallyd_rollup_runs_total'),
        'rollup_s': round(dm('tallyd_rollup_duration_seconds_sum'), 2),
        'rollup_errors': dm('tallyd_rollup_errors_total'),
        'proto_step': a.proto_step, 'proto_batch': a.proto_batch if a.proto_step else None,
        'proto_async': a.proto_async, 'proto_rows': proto['rows'], 'proto_steps': proto['steps'],
        'slots': {k: slots1.get(k, 0) - slots0.get(k, 0) if k in ('ins', 'upd', 'hot_upd', 'del', 'autovacuums', 'autoanalyzes') else slots1.get(k) for k in slots1},
        'version_downloads': {k: vd1.get(k, 0) - vd0.get(k, 0) if k in ('ins', 'upd', 'hot_upd', 'del', 'autovacuums', 'autoanalyzes') else vd1.get(k) for k in vd1},
        'exact': ex[0],
        'load1': os.getloadavg()[0],
        'top_statements': stmts,
        'trace': trace,
    }
    if a.sample_waits:
        out['wait_samples'] = samples
    print(json.dumps(out))
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == '__main__':
    main()
