#!/bin/bash
# A private, durable PostgreSQL 15 for the rollup study, with the bench's settings
# (bench/src/env.rs: fsync and synchronous_commit on, shared_buffers 1GB, max_wal_size 4GB)
# plus pg_stat_statements preloaded (off unless STATS=all|top). Runs as the postgres OS user.
#   pg.sh start | stop | psql [args] | pid | cpu
set -euo pipefail
ROOT=${ROLLPERF_ROOT:-/tmp/rollperf}
BIN=/usr/lib/postgresql/15/bin
PORT=${ROLLPERF_PORT:-55432}
DATA=$ROOT/pg
SOCK=$ROOT/sock
STATS=${STATS:-none}
case "${1:-}" in
start)
    mkdir -p "$ROOT" "$SOCK"; chmod 755 "$ROOT"; chown postgres "$SOCK"; chmod 777 "$SOCK"; touch "$ROOT/pg.log"; chown postgres "$ROOT/pg.log"
    if [ ! -f "$DATA/PG_VERSION" ]; then
        mkdir -p "$DATA"; chown postgres "$DATA"
        (cd "$ROOT" && runuser -u postgres -- "$BIN/initdb" -D "$DATA" -U postgres --auth=trust \
            --encoding=UTF8 --locale=C -N >/dev/null)
    fi
    (cd "$ROOT" && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -l "$ROOT/pg.log" -w start -o "\
        -k $SOCK -p $PORT -c listen_addresses= -c unix_socket_permissions=0777 \
        -c fsync=${FSYNC:-on} -c synchronous_commit=${SYNC:-on} -c shared_buffers=1GB -c max_wal_size=4GB \
        -c max_connections=100 -c shared_preload_libraries=pg_stat_statements \
        -c pg_stat_statements.track=$STATS -c pg_stat_statements.track_planning=on \
        -c pg_stat_statements.max=10000 -c track_io_timing=on -c track_functions=all \
        -c log_autovacuum_min_duration=${LOG_AV:--1} -c log_lock_waits=on -c deadlock_timeout=${DEADLOCK_TIMEOUT:-1s}" >/dev/null)
    ;;
stop)
    (cd "$ROOT" && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null) || true ;;
wipe)
    "$0" stop; rm -rf "$ROOT/pg" ;;
psql)
    shift; exec psql -X -h "$SOCK" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 "$@" ;;
pid)
    head -1 "$DATA/postmaster.pid" ;;
url)
    echo "host=$SOCK port=$PORT user=postgres dbname=postgres" ;;
cpu)
    # Server CPU seconds: the postmaster's own and reaped children's time plus its live children's
    # (as bench/src/procfs.rs server_cpu_seconds).
    python3 "$(dirname "$0")/servercpu.py" "$(head -1 "$DATA/postmaster.pid")" ;;
*) echo "usage: $0 start|stop|wipe|psql|pid|url|cpu" >&2; exit 2 ;;
esac
