#!/bin/bash
# The rollup alone, as a user runs it: `tallyd rollup --until-empty --batch-rows N` on the
# tables as they are; prints rows folded, wall, server CPU (whole server) per row.
# usage: rollup_cli.sh BATCH_ROWS
set -euo pipefail
HERE=$(dirname "$0")
CFG=${CLI_CONFIG:-/tmp/rollperf/cli/config.toml}
before=$("$HERE/pg.sh" psql -Atc "SELECT count(*) FROM tallyd.slots")
c0=$("$HERE/pg.sh" cpu); t0=$(date +%s.%N)
"$HERE/../../target/release/tallyd" --config "$CFG" rollup --until-empty --batch-rows "$1" >/tmp/rollperf/cli/out.txt 2>&1
t1=$(date +%s.%N); c1=$("$HERE/pg.sh" cpu)
after=$("$HERE/pg.sh" psql -Atc "SELECT count(*) FROM tallyd.slots")
python3 -c "
rows=$before-$after; w=$t1-$t0; c=$c1-$c0
print(f'{{\"batch\": $1, \"rows\": {rows}, \"wall_s\": {w:.2f}, \"rows_per_s\": {rows/w:.0f}, \"server_cpu_s\": {c:.2f}, \"server_us_per_row\": {c/max(rows,1)*1e6:.2f}, \"busy\": {c/w:.2f}, \"load1\": $(cut -d' ' -f1 /proc/loadavg)}}')"
