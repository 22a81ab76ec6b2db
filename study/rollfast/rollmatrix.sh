#!/bin/bash
# The rollup alone, V14's step against the study's prototype (design b) and V13's tallyd.rollup,
# each from the same restored 399,973 slot rows (fold.py snapshot of what flushsim.py slots left
# in database proto), ROUNDS times interleaved.
#   ROUNDS=3 OUT=results/roll.jsonl ./rollmatrix.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$HERE/results/roll.jsonl}
VARIANTS=${VARIANTS:-"v14 1000|v14 5000|v14 20000|set_cursor 1000 --async|set_cursor 5000 --async"}
IFS='|' read -ra VS <<< "$VARIANTS"
for r in $(seq "$ROUNDS"); do
    for v in "${VS[@]}"; do
        ROLLPERF_DB=proto python3 "$HERE/fold.py" restore
        ROLLPERF_DB=proto python3 "$HERE/fold.py" run $v --tag "$(echo "$v" | tr ' ' '_')" | sed "s/^{/{\"round\": $r, /" >> "$OUT"
    done
done
