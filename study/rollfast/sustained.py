#!/usr/bin/env python3
"""The sustained case: RATE new distinct keys per second (one event each, keys never seen
before) for SECONDS, to the issue's windowed counter vd rolled into version_downloads
(insert_missing), daemon defaults. Every 5 s: slot rows waiting (inserted - deleted, from
pg_stat_user_tables: cheap, up to a second late) and the application's table lag (events sent
- rows inserted into version_downloads, each key being new: one row per event), in rows and in
seconds of load.

  sustained.py [--rate 50000] [--seconds 90] [--alltime] [--proto-step set_cursor --proto-batch N]
               [--tag T] [--tallyd PATH]

--alltime: the issue's other sustained case, an all-time counter `vd` (tallyd.rollups); the
table lag is then events sent - rows inserted into tallyd.rollups.
"""
import argparse, json, os, random, shutil, socket, subprocess, sys, threading, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e import Psql, psql, config, metrics, postmaster, TABLE, ROOT  # noqa: E402
from servercpu import server_cpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rate', type=int, default=50_000)
    ap.add_argument('--seconds', type=int, default=90)
    ap.add_argument('--drain-seconds', type=int, default=120)
    ap.add_argument('--proto-step')
    ap.add_argument('--proto-batch', type=int, default=1000)
    ap.add_argument('--tag', default='sustained')
    ap.add_argument('--alltime', action='store_true')
    ap.add_argument('--tallyd', default=os.path.join(HERE, '../../target/release/tallyd'))
    a = ap.parse_args()
    # e2e.config's fields
    a.rollup = 'off' if a.proto_step else 'on'
    a.interval_ms = a.batch_rows = a.flush_connections = None
    psql(TABLE)
    psql("""DO $$ BEGIN IF to_regclass('tallyd.slots') IS NOT NULL THEN
              TRUNCATE tallyd.slots, tallyd.rollups, tallyd.flushes, tallyd.rollup_held,
                       tallyd.rollup_rejects, tallyd.instances;
            END IF; END $$""")
    d = f'{ROOT}/d-{a.tag}'
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    os.chmod(d, 0o700)
    port = random.randrange(20000, 30000)
    open(f'{d}/config.toml', 'w').write(config(d, port, a))
    daemon = subprocess.Popen([a.tallyd, '--config', f'{d}/config.toml', 'run'],
                              stdout=open(f'{d}/tallyd.log', 'w'), stderr=subprocess.STDOUT)
    while not (os.path.exists(f'{d}/tallyd.sock') and metrics(port)):
        time.sleep(0.05)
    p = Psql()
    # The socket and the metrics may answer before the daemon has prepared a fresh database.
    while p.one("SELECT to_regclass('tallyd.slots') IS NOT NULL") != 't':
        time.sleep(0.1)
    pm = postmaster()
    stop = threading.Event()
    stepped = {'rows': 0}
    if a.proto_step:
        from fold import STEPS
        stepper = Psql()
        sql = STEPS.get(a.proto_step, a.proto_step)

        def stepping():
            while not stop.is_set():
                n = int(stepper.one(sql % a.proto_batch))
                stepped['rows'] += n
                if n < a.proto_batch:
                    time.sleep(0.1)
        threading.Thread(target=stepping, daemon=True).start()

    def stat(rel):
        r = p.q(f"SELECT n_tup_ins, n_tup_del FROM pg_stat_user_tables WHERE relid = '{rel}'::regclass")[0]
        return int(r[0]), int(r[1])
    s_ins0, s_del0 = stat('tallyd.slots')
    table = 'tallyd.rollups' if a.alltime else 'public.version_downloads'
    v_ins0, _ = stat(table)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f'{d}/tallyd.sock')
    sent = 0
    key = 10_000_000
    t0 = time.monotonic()
    cpu0 = server_cpu(pm)
    samples = []
    next_sample = t0
    tick = 0.1
    per_tick = a.rate // 10
    while True:
        now = time.monotonic()
        if now >= next_sample:
            si, sd = stat('tallyd.slots')
            vi, _ = stat(table)
            waiting = (si - s_ins0) - (sd - s_del0)
            lag = sent - (vi - v_ins0)
            samples.append({'t': round(now - t0), 'sent': sent, 'slot_rows_waiting': waiting,
                            'table_lag_rows': lag, 'table_lag_s': round(lag / a.rate, 1),
                            'server_cpu_s': round(server_cpu(pm) - cpu0, 1)})
            print(json.dumps(samples[-1]), file=sys.stderr)
            next_sample += 5
        if now - t0 < a.seconds:
            target = int((now - t0) / tick + 1) * per_tick
            if sent < target:
                buf = ''.join(f'vd {k}\n' for k in range(key, key + per_tick)).encode()
                s.sendall(buf)
                key += per_tick
                sent += per_tick
                continue
        elif now - t0 > a.seconds + a.drain_seconds or (samples and samples[-1]['table_lag_rows'] <= 0 and now - t0 > a.seconds + 5):
            break
        time.sleep(0.01)
    stop.set()
    s.sendall(b'!sync\n')
    s.recv(100)
    out = {'tag': a.tag, 'tallyd': a.tallyd, 'alltime': a.alltime, 'rate': a.rate, 'seconds': a.seconds, 'proto_step': a.proto_step,
           'proto_batch': a.proto_batch if a.proto_step else None, 'samples': samples,
           'load1': os.getloadavg()[0]}
    print(json.dumps(out))
    daemon.terminate()
    daemon.wait(60)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == '__main__':
    main()
