#!/usr/bin/env python3
"""One line per flushsim/fold JSON result on stdin: the figures the report compares."""
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith('{'):
        print(line); continue
    d = json.loads(line)
    keys = ['round', 'tag', 'exact', 'flush_wall_s', 'flush_rows_per_s', 'server_us_per_flight_row_flush_phase',
            'flush_backend_us_per_row', 'rollup_folded_total', 'end_to_end_server_cpu_s', 'server_us_per_event', 'load1']
    print(' '.join(f'{k}={d[k]}' for k in keys if k in d))
