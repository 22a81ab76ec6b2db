#!/bin/bash
# The per-row cost table of the report, ROUNDS times interleaved (the machine is shared: each
# round runs every variant once, so load drifts hit all alike). Appends JSON lines to OUT.
#   ROUNDS=3 OUT=results/matrix.jsonl ./matrix.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$HERE/results/matrix.jsonl}
for r in $(seq "$ROUNDS"); do
    # flush side: the 884,763 rows of the issue's flights (flights.py 128000,2750000,1122000)
    for m in "none" "slots" "direct" "direct_insert" "mover" "append --fold-partition" \
             "slots --prefill" "direct --prefill" "direct_nolock --prefill" "mover --prefill"; do
        tag="flush:$(echo "$m" | tr ' ' '_')"
        ROLLPERF_DB=proto python3 "$HERE/flushsim.py" $m --tag "$tag" | sed "s/^{/{\"round\": $r, /" >> "$OUT"
    done
    # rollup side: the 399,973 slot rows the daemon's flush left (fold.py snapshot), each from the
    # same restored state
    for v in "v11_static 1000" "v11_nolock 1000" "set_cursor 1000" "set_cursor_adv 1000" "set_cursor 5000" \
             "set_cursor 1000 --async"; do
        ROLLPERF_DB=postgres python3 "$HERE/fold.py" restore
        ROLLPERF_DB=postgres python3 "$HERE/fold.py" run $v | sed "s/^{/{\"round\": $r, /" >> "$OUT"
    done
done
