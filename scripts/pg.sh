#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on 127.0.0.1 for tests, benchmarks and the demo.
#
#   scripts/pg.sh start DIR    initdb into DIR (if new), start on a free port, print DATABASE_URL
#   scripts/pg.sh stop DIR     stop the server started in DIR (by its PID)
#   scripts/pg.sh url DIR      print the DATABASE_URL of the server in DIR
#   scripts/pg.sh start-tls DIR  the same server, TLS only: a CA and a server certificate
#                                for DNS:localhost (no IP name) made with openssl into
#                                DIR/tls (ca.crt, and other-ca.crt that signed nothing);
#                                pg_hba.conf accepts `hostssl` only. Prints a verify-full
#                                DATABASE_URL naming DIR/tls/ca.crt.
#
# The server runs as the unprivileged `postgres` user (initdb refuses root) with fsync
# off: this is scratch data. It never listens beyond loopback.
#
#   LEASEHOLD_PG_FSYNC=on      durable as in production instead: fsync, synchronous_commit
#                              and full_page_writes on (the capacity bench, `make
#                              bench-postgres`). Default off: tests need no durability.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:?usage: pg.sh start|start-tls|stop|url DIR}
dir=${2:?usage: pg.sh start|start-tls|stop|url DIR}

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

url() { echo "postgres://postgres@127.0.0.1:$(cat "$dir/port")/postgres?sslmode=disable"; }
tls_url() { echo "postgres://postgres@localhost:$(cat "$dir/port")/postgres?sslmode=verify-full&sslrootcert=$dir/tls/ca.crt"; }

# A CA, a second CA that signs nothing (the "wrong CA" of tests), and a server certificate
# for DNS:localhost signed by the first. P-256 keys: quick to make. Valid two days.
make_certs() {
  local t="$dir/tls" ca_ext=(-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign)
  mkdir -p "$t"
  [ -f "$t/server.crt" ] && return 0
  for ca in ca other-ca; do
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
      -subj "/CN=leasehold test $ca" "${ca_ext[@]}" -keyout "$t/$ca.key" -out "$t/$ca.crt" 2>/dev/null
  done
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
    -keyout "$t/server.key" -out "$t/server.csr" 2>/dev/null
  printf '%s\n' subjectAltName=DNS:localhost basicConstraints=critical,CA:FALSE \
    keyUsage=critical,digitalSignature extendedKeyUsage=serverAuth >"$t/server.ext"
  openssl x509 -req -in "$t/server.csr" -CA "$t/ca.crt" -CAkey "$t/ca.key" -CAcreateserial \
    -days 2 -extfile "$t/server.ext" -out "$t/server.crt" 2>/dev/null
  chmod 600 "$t/server.key"
  [ "$(id -u)" = 0 ] && chown -R postgres: "$t"
  return 0
}

case "$cmd" in
  start|start-tls)
    bindir=$("$here/ensure-postgres.sh")
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    [ -f "$dir/port" ] || free_port >"$dir/port"
    durability="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    case "${LEASEHOLD_PG_FSYNC:-off}" in
      on) durability="-c fsync=on -c synchronous_commit=on -c full_page_writes=on" ;;
      off) ;;
      *) echo "pg.sh: LEASEHOLD_PG_FSYNC must be on or off, not ${LEASEHOLD_PG_FSYNC}" >&2; exit 2 ;;
    esac
    tls_opts=""
    if [ "$cmd" = start-tls ]; then
      make_certs
      printf '%s\n' "local all all trust" "hostssl all all 127.0.0.1/32 trust" >"$dir/data/pg_hba.conf"
      tls_opts="-c ssl=on -c ssl_cert_file=$dir/tls/server.crt -c ssl_key_file=$dir/tls/server.key"
    fi
    as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 start -o \
      "-c listen_addresses=127.0.0.1 -p $(cat "$dir/port") -k $dir $durability \
       -c max_connections=400 -c shared_buffers=256MB $tls_opts" >/dev/null \
      || { tail -20 "$dir/postgres.log" >&2; exit 1; }
    head -1 "$dir/data/postmaster.pid" >"$dir/pid"
    if [ "$cmd" = start-tls ]; then tls_url; else url; fi
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
  *) echo "usage: pg.sh start|start-tls|stop|url DIR" >&2; exit 2 ;;
esac
