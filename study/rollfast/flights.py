#!/usr/bin/env python3
"""Fills rollperf.flights with the flights a flush would write for the issue's load: the 4
clients' lines interleaved in send order, cut into flights of EVENTS_PER_FLIGHT events, each
flight's keys split over WORKERS flush workers (key % WORKERS), one row per (flight, worker,
key) with its events. Choose EVENTS_PER_FLIGHT so that the rows match what tallyd's flushes
wrote (e2e.py --rollup off: flush_rows).

  flights.py EVENTS_PER_FLIGHT [WORKERS=2] [--new-keys N --flights F]
  --new-keys: the sustained case instead: F flights of N keys never seen before, one event each.
"""
import collections, io, os, subprocess, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e import CONNINFO, load  # noqa: E402


def main():
    out = io.StringIO()
    workers = int(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith('--') else 2
    rows = 0
    if '--new-keys' in sys.argv:
        n = int(sys.argv[sys.argv.index('--new-keys') + 1])
        flights = int(sys.argv[sys.argv.index('--flights') + 1])
        k = 10_000_000
        for f in range(flights):
            for _ in range(n):
                out.write(f'{f}\t{k % workers}\t{k}\t1\n')
                k += 1
                rows += 1
    else:
        bufs = [b.split(b'\n')[:-1] for b in load(4, 1_000_000, 400_000)]
        lines = [l for quad in zip(*bufs) for l in quad]
        # one size for all flights, or the sizes of each ("128000,2750000,1122000")
        sizes = [int(x) for x in sys.argv[1].split(',')]
        if len(sizes) == 1:
            sizes = [sizes[0]] * ((len(lines) + sizes[0] - 1) // sizes[0])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for f, (start, per) in enumerate(zip(starts, sizes)):
            c = collections.Counter(l[3:] for l in lines[start:start + per])
            for key, n in c.items():
                k = int(key)
                out.write(f'{f}\t{k % workers}\t{k}\t{n}\n')
                rows += 1
    sql = ('TRUNCATE rollperf.flights; COPY rollperf.flights FROM STDIN; '
           'ANALYZE rollperf.flights;')
    subprocess.run(['psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', CONNINFO, '-c', 'TRUNCATE rollperf.flights'], check=True)
    subprocess.run(['psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', CONNINFO, '-c', 'COPY rollperf.flights (flight, worker, key, n) FROM STDIN'],
                   input=out.getvalue(), text=True, check=True)
    # statements of 5,000 rows in the flight's key order (text order, as tallyd sorts)
    subprocess.run(['psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', CONNINFO, '-c', '''
        UPDATE rollperf.flights f SET chunk = c.chunk FROM (
            SELECT flight, worker, key,
                   (row_number() OVER (PARTITION BY flight, worker ORDER BY key) - 1) / 5000 AS chunk
            FROM rollperf.flights) c
        WHERE (f.flight, f.worker, f.key) = (c.flight, c.worker, c.key)'''], check=True)
    subprocess.run(['psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', CONNINFO, '-c', 'ANALYZE rollperf.flights'], check=True)
    print(f'{rows} rows')


if __name__ == '__main__':
    main()
