#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on 127.0.0.1 for tests, benchmarks and the demo.
#
#   scripts/pg.sh start DIR    initdb into DIR (if new), start on a free port, print DATABASE_URL
#   scripts/pg.sh stop DIR     stop the server started in DIR (by its PID)
#   scripts/pg.sh url DIR      print the DATABASE_URL of the server in DIR
#
# The server runs as the unprivileged `postgres` user (initdb refuses root) with fsync
# off: this is scratch data. It never listens beyond loopback.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:?usage: pg.sh start|stop|url DIR}
dir=${2:?usage: pg.sh start|stop|url DIR}

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

url() { echo "postgres://postgres@127.0.0.1:$(cat "$dir/port")/postgres?sslmode=disable"; }

case "$cmd" in
  start)
    bindir=$("$here/ensure-postgres.sh")
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    [ -f "$dir/port" ] || free_port >"$dir/port"
    as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 start -o \
      "-c listen_addresses=127.0.0.1 -p $(cat "$dir/port") -k $dir -c fsync=off -c synchronous_commit=off \
       -c full_page_writes=off -c max_connections=400 -c shared_buffers=256MB" >/dev/null \
      || { tail -20 "$dir/postgres.log" >&2; exit 1; }
    head -1 "$dir/data/postmaster.pid" >"$dir/pid"
    url
    ;;
  stop)
    if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
      pid=$(cat "$dir/pid")
      kill -INT "$pid" # fast shutdown
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$dir/pid"
    ;;
  url) url ;;
  *) echo "usage: pg.sh start|stop|url DIR" >&2; exit 2 ;;
esac
