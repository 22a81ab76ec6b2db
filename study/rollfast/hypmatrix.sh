#!/bin/bash
# Issue 32's hypothesis, item 3: the flush writing a rollup_into counter's window rows straight
# into the target with the peer's plain upsert (mode `upsert`), and an all-time counter's rows
# into tallyd.rollups (`upsert_rollups`), against today's slot upsert and the peer's mover, on the
# same recorded flights (flights.py 128000,2750000,1122000), ROUNDS times interleaved.
#   ROUNDS=3 OUT=results/hyp.jsonl ./hypmatrix.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$HERE/results/hyp.jsonl}
for r in $(seq "$ROUNDS"); do
    for m in "none" "slots" "upsert" "mover" "slots --prefill" "upsert --prefill" "mover --prefill" \
             "slots --span all" "upsert_rollups --span all" "upsert_rollups --span all --prefill"; do
        tag="$(echo "$m" | tr ' ' '_')"
        ROLLPERF_DB=proto python3 "$HERE/flushsim.py" $m --tag "$tag" | sed "s/^{/{\"round\": $r, /" >> "$OUT"
    done
done
